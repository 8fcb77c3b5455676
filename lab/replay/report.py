"""The replay's JSON report: per epoch and arm, per arm, per tool; the targets; a headline table."""

from __future__ import annotations

import datetime as dt
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.figures import percentile

from .arms import Arm
from .exactness import EXACT_KEYS
from .harness import Replay
from .samples import CallSample, EpochRun, mean
from .workload import VERIFY_STEP

HIT_VS_ORACLE_POINTS = 0.5  # target: |hit rate - oracle hit rate| below this many points (no budget)
MEDIAN_SPEEDUP = 7.0  # target (terminal): median tool-call latency reduced at least this much
MISS_OVERHEAD_P95_MS = 5.0  # target: lookup overhead on a miss, P95, added to the tool's own time
VERIFICATION_COST_PCT = 10.0  # target (terminal, tool-server mode): verification's cost on the median miss
# A tool-server miss's phases as the service names them (Phases, sandboxes/services/materialize.py).
PHASES = (
    "lanes",
    "claim",
    "lookup",
    "wait",
    "background_wait",
    "snapshot_wait",
    "prepare",
    "materialize",
    "replay",
    "verify",
    "exec",
    "fingerprint",
    "processes",
    "record",
    "snapshot",
)
VERIFICATION_PHASES = ("verify", "fingerprint")


def _latency(values: list[float]) -> dict[str, float]:
    """Percentiles and mean in ms; zeros for no calls (the plots and the headline read them)."""
    return {
        **{f"p{q}": percentile(values, q, 3) or 0.0 for q in (50, 95, 99)},
        "mean": round(mean(values), 3),
        "n": len(values),
    }


def _quantiles(values: list[float], points: int = 101) -> list[float]:
    """Latency quantiles 0..100 % for the CDF plot (the raw samples are not kept)."""
    if not values:
        return []
    ordered = sorted(values)
    return [round(ordered[min(len(ordered) - 1, int(i * (len(ordered) - 1) / (points - 1)))], 3) for i in range(points)]


def _miss_overheads(run: EpochRun) -> list[float]:
    """Client mode: a miss's latency minus the time spent in sandboxes on the rollout's thread
    (start, fork, replay, the call). It includes waiting for the previous miss's background
    work (`background_wait_ms`), whose snapshot is sandbox time spent on another thread."""
    return [s.latency_ms - s.env_ms for s in run.calls if s.cached is False and s.env_ms is not None]


def _miss_lookups(run: EpochRun, field: str = "lookup_ms") -> list[float]:
    """Client mode, per miss: `lookup_ms` its lookup as the rollout saw it, `lookup_server_ms` the
    service's own share of it (Server-Timing: the rest is the network and the client), or
    `background_wait_ms` its wait for the previous miss's record and snapshot."""
    return [getattr(s, field) for s in run.calls if s.cached is False and getattr(s, field) is not None]


def tool_time_s(samples: list[CallSample]) -> float:
    """Tool time: the calls' latencies as the rollouts saw them, summed, in seconds."""
    return round(sum(s.latency_ms for s in samples) / 1000, 3)


def _phase_fields(runs: list[EpochRun]) -> dict[str, Any]:
    """Tool-server mode, over the misses the service answered (`CallSample.phases_ms`).

    `miss_phases_ms`: per phase of PHASES (then any other the service reports), the P50, P95 and
    mean in ms over all these misses, a miss that did not go through the phase counting 0 ms in
    it; `total_s`, the phase's time summed over them; `misses`, those whose phases name it (the
    service times some phases also when they have nothing to do: `fingerprint` of a call that
    changed nothing, about 0 ms). `other` is each miss's latency as the rollout saw it less the
    sum of its phases: the HTTP round trip, the rollout's claim and release, the history append,
    the task row (its `misses`: all).

    `verification`: what the state checks cost a miss. Per miss, its verification is `verify`
    (the fingerprint of a materialized or caught-up sandbox, compared with its node's) plus
    `fingerprint` (the fingerprint of the state the call left, recorded for later checks).
    `median_miss_ms` is the median latency of the misses, `median_verification_ms` the median of
    their verifications, `median_miss_unverified_ms` the median of (latency - verification) over
    the same misses; `share_pct` = 100 x median verification / median miss, and `cost_pct` =
    100 x (median miss / median unverified miss - 1): how much verification adds to the median
    miss (at most VERIFICATION_COST_PCT on terminal: docs/lab/replays.md). Medians are
    nearest-rank, as P50."""
    misses = [s for run in runs for s in run.calls if s.cached is False and s.phases_ms is not None]
    if not misses:
        return {}
    names = [*PHASES, *sorted({p for s in misses for p in s.phases_ms} - set(PHASES))]
    phases: dict[str, Any] = {}
    for name in names:
        values = [s.phases_ms.get(name, 0.0) for s in misses]
        phases[name] = {
            **{f"p{q}": percentile(values, q, 3) for q in (50, 95)},
            "mean": round(mean(values), 3),
            "total_s": round(sum(values) / 1000, 3),
            "misses": sum(1 for s in misses if name in s.phases_ms),
        }
    other = [s.latency_ms - sum(s.phases_ms.values()) for s in misses]
    phases["other"] = {
        **{f"p{q}": percentile(other, q, 3) for q in (50, 95)},
        "mean": round(mean(other), 3),
        "total_s": round(sum(other) / 1000, 3),
        "misses": len(misses),
    }
    verification = [sum(s.phases_ms.get(p, 0.0) for p in VERIFICATION_PHASES) for s in misses]
    median_miss = percentile([s.latency_ms for s in misses], 50, 3)
    median_unverified = percentile([s.latency_ms - v for s, v in zip(misses, verification)], 50, 3)
    median_verification = percentile(verification, 50, 3)
    return {
        "miss_phases_ms": phases,
        "verification": {
            "misses": len(misses),
            "median_miss_ms": median_miss,
            "median_verification_ms": median_verification,
            "median_miss_unverified_ms": median_unverified,
            "share_pct": round(100 * median_verification / median_miss, 2) if median_miss else None,
            "cost_pct": round(100 * (median_miss / median_unverified - 1), 2) if median_unverified else None,
        },
    }


def _step_fields(runs: list[EpochRun], step: str = VERIFY_STEP) -> dict[str, Any]:
    """The calls the workload labelled `step` (Workload.steps; terminal: the runs of the task's
    verifier): `verify_step`, all of them; `final_verify`, the last of each rollout, the final
    verification that computes the reward. Each: calls, hits, and their tool time (tool_time_s).
    Empty when the workload labels no call so."""
    calls = [s for run in runs for s in run.calls if s.step == step]
    if not calls:
        return {}
    last: dict[tuple, CallSample] = {}
    for sample in calls:
        rollout = (sample.epoch, sample.task, sample.rollout)
        if rollout not in last or sample.position > last[rollout].position:
            last[rollout] = sample

    def figures(samples: list[CallSample]) -> dict[str, Any]:
        return {"calls": len(samples), "hits": sum(1 for s in samples if s.cached), "tool_time_s": tool_time_s(samples)}

    return {f"{step}_step": figures(calls), f"final_{step}": figures(list(last.values()))}


def _miss_fields(runs: list[EpochRun]) -> dict[str, dict[str, float]]:
    overheads = [o for run in runs for o in _miss_overheads(run)]
    if not overheads:
        return {}
    return {
        "miss_overhead_ms": _latency(overheads),
        **{
            f"miss_{field}": _latency([v for run in runs for v in _miss_lookups(run, field)])
            for field in ("lookup_ms", "lookup_server_ms", "background_wait_ms")
        },
    }


@dataclass(frozen=True)
class IssuedOracle:
    """The harness's own oracle of one arm, per epoch: calls whose state and call an earlier call
    of any rollout of the arm had issued (by start time; the graph is kept across epochs). It
    counts a call issued while an identical one was still running, which the service's oracle (the
    node existed at lookup) does not: the bound for a cache that merges concurrent identical misses.

    `hits` keeps the known-state rule: a call after an unknown-state event of its rollout
    (`CallSample.unshared`) can only hit what the same rollout issued after the event. `no_rule_hits`
    is the same oracle as if no event took a rollout off the shared graph (the no-fault oracle);
    in neither is the answer of an event's own call (timed out, failed, injected) there to hit.
    `forbidden` counts the hits the rule forbids: after an unknown-state event of the rollout,
    from anything but what the rollout itself issued after it; and on the shared graph, from what
    only rollouts off it had issued."""

    hits: dict[int, int]
    no_rule_hits: dict[int, int]
    forbidden: dict[int, int]
    forbidden_examples: list[dict[str, Any]]  # the first few of them


def issued_oracle(runs: list[EpochRun], keep_examples: int = 10) -> IssuedOracle:
    hits, forbidden = _oracle_pass(runs, rule=True)
    no_rule_hits, _ = _oracle_pass(runs, rule=False)
    examples = [
        {
            "epoch": s.epoch,
            "task": s.task,
            "rollout": s.rollout,
            "position": s.position,
            "tool": s.tool,
            "after_unknown_state": s.unshared,
        }
        for s in sorted((s for samples in forbidden.values() for s in samples), key=lambda s: s.started)
    ]
    return IssuedOracle(
        hits, no_rule_hits, {epoch: len(samples) for epoch, samples in forbidden.items()}, examples[:keep_examples]
    )


def _oracle_pass(runs: list[EpochRun], *, rule: bool) -> tuple[dict[int, int], dict[int, list[CallSample]]]:
    """Oracle hits per epoch, and the hits the rule forbids (with `rule`)."""
    seen: set[tuple] = set()
    off_graph: set[tuple] = set()  # what rollouts off the shared graph issued, keyed as if shared
    hits: dict[int, int] = {}
    forbidden: dict[int, list[CallSample]] = {}
    for run in sorted(runs, key=lambda r: r.epoch):
        hits[run.epoch], forbidden[run.epoch] = 0, []
        # A rollout that waited for another's run of the same call (single flight) is answered from
        # it, though it may have sent its call first: a rollout on the shared graph that sent the
        # call to be run before this one was answered justifies its hit.
        issued_shared: dict[tuple, float] = {}
        for sample in run.calls:
            if sample.key is not None and sample.cached is False and not sample.event and not sample.unshared:
                key = _oracle_key(sample, rule)
                issued_shared[key] = min(issued_shared.get(key, sample.started), sample.started)
        for sample in sorted(run.calls, key=lambda s: s.started):
            if sample.key is None:
                continue
            key = _oracle_key(sample, rule)
            hits[run.epoch] += key in seen
            answered = sample.started + sample.latency_ms / 1000
            if (
                sample.cached
                and key not in seen
                and (sample.unshared or key in off_graph)
                and not (not sample.unshared and issued_shared.get(key, answered) < answered)
            ):
                forbidden[run.epoch].append(sample)
            if not sample.event:
                seen.add(key)
                if rule and sample.unshared:
                    off_graph.add(_oracle_key(sample, False))
    return hits, forbidden


def _oracle_key(sample: CallSample, rule: bool) -> tuple:
    if rule and sample.unshared:  # its rollout's own branch
        return sample.task, sample.epoch, sample.rollout, sample.key
    return sample.task, sample.key


def _fault_counts(calls: list[CallSample]) -> dict[str, Any]:
    return {
        "fired": dict(Counter(s.fault for s in calls if s.fault)),
        "calls_after_unknown_state": sum(1 for s in calls if s.unshared),
        "retried_calls": sum(1 for s in calls if s.retries),
        "retries": sum(s.retries for s in calls),
        "failed_calls": sum(1 for s in calls if s.failed),
        # The cache kept an answer that says timed out, and served it.
        "timed_out_hits": sum(1 for s in calls if s.cached and s.answer_timed_out),
    }


def epoch_metrics(run: EpochRun, oracle: IssuedOracle, faults: bool = False) -> dict[str, Any]:
    latencies = [s.latency_ms for s in run.calls]
    hits = sum(1 for s in run.calls if s.cached)
    rollout_s = [r.seconds for r in run.rollouts]
    out: dict[str, Any] = {
        "calls": len(run.calls),
        "hits": hits,
        "hit_rate": hits / len(run.calls) if run.calls else 0.0,
        "latency_ms": _latency(latencies),
        "hit_latency_ms": _latency([s.latency_ms for s in run.calls if s.cached]),
        "miss_latency_ms": _latency([s.latency_ms for s in run.calls if s.cached is False]),
        "tool_time_s": tool_time_s(run.calls),
        "rollout_s": {"mean": round(mean(rollout_s), 3), "max": round(max(rollout_s, default=0.0), 3)},
        "step_s": round(run.step_s, 3),
        "slowest_rollout_s": round(max(rollout_s, default=0.0), 3),
        "warm_wait_s": round(run.warm_wait_s, 3),
        "sandboxes": {key: round(value, 1) for key, value in run.sandboxes.items()},
        "exact": run.exact,
        "issued_oracle_hit_rate": oracle.hits[run.epoch] / len(run.calls) if run.calls else 0.0,
    }
    if faults:
        out["no_fault_oracle_hit_rate"] = oracle.no_rule_hits[run.epoch] / len(run.calls) if run.calls else 0.0
        out["forbidden_hits"] = oracle.forbidden[run.epoch]
        out["faults"] = _fault_counts(run.calls)
    out.update(_miss_fields([run]))
    out.update(_phase_fields([run]))
    out.update(_step_fields([run]))
    if run.service:
        out["service"] = run.service
        out["oracle_hit_rate"] = run.service["oracle_hit_rate"]
        out["service_hit_rate"] = run.service["hit_rate"]
    return out


def arm_summary(runs: list[EpochRun], oracle: IssuedOracle, faults: bool = False) -> dict[str, Any]:
    calls = [s for run in runs for s in run.calls]
    latencies = [s.latency_ms for s in calls]
    service = [run.service for run in runs if run.service]
    service_calls = sum(s.get("calls", 0) for s in service)
    out = {
        "calls": len(calls),
        "hits": sum(1 for s in calls if s.cached),
        "hit_rate": sum(1 for s in calls if s.cached) / len(calls) if calls else 0.0,
        "latency_ms": _latency(latencies),
        "latency_quantiles_ms": _quantiles(latencies),
        "tool_time_s": tool_time_s(calls),
        "step_s_total": round(sum(run.step_s for run in runs), 3),
        "issued_oracle_hit_rate": sum(oracle.hits.values()) / len(calls) if calls else 0.0,
        "exact": {key: sum(run.exact.get(key, 0) for run in runs) for key in EXACT_KEYS},
    }
    if faults:
        out["no_fault_oracle_hit_rate"] = sum(oracle.no_rule_hits.values()) / len(calls) if calls else 0.0
        out["forbidden_hits"] = sum(oracle.forbidden.values())
        out["faults"] = _fault_counts(calls)
    out.update(_miss_fields(runs))
    out.update(_phase_fields(runs))
    out.update(_step_fields(runs))
    if service:
        out["service_calls"] = service_calls
        out["service_hit_rate"] = sum(s.get("hits", 0) for s in service) / service_calls if service_calls else 0.0
        out["oracle_hit_rate"] = sum(s.get("oracle_hits", 0) for s in service) / service_calls if service_calls else 0.0
        out["state_hits"] = sum(s.get("state_hits", 0) for s in service)
        out["state_oracle_hit_rate"] = (
            sum(s.get("state_oracle_hits", 0) for s in service) / service_calls if service_calls else 0.0
        )
        out["snapshots_live_end"] = service[-1].get("snapshots_live", 0)
        out["snapshot_bytes_live_end"] = service[-1].get("snapshot_bytes_live", 0)
    return out


def targets(workload: str, arms: dict[str, dict[str, Any]], match: str | None = None) -> dict[str, Any]:
    """With `match` "state", the service's hit rate is held to the state oracle (a call seen before
    after the same history or from a state with the same verified fingerprint) and shown above the
    longest-prefix one; otherwise to the longest-prefix oracle."""
    out: dict[str, Any] = {}
    cached = {name: a for name, a in arms.items() if Arm.parse(name).mode != "nocache"}
    out["zero_mismatched_hits"] = {
        "met": all(a["exact"]["hits_mismatches"] == 0 for a in cached.values()),
        "hits_checked": sum(a["exact"]["hits_checked"] for a in cached.values()),
        "mismatches": sum(a["exact"]["hits_mismatches"] for a in cached.values()),
        # answers a fresh execution of the same history also gave (exactness.REPRODUCE_TRIES)
        "nondeterministic": sum(a["exact"].get("hits_nondeterministic", 0) for a in cached.values()),
    }
    out["zero_mismatched_misses"] = {
        "met": all(a["exact"]["misses_mismatches"] == 0 for a in cached.values()),
        "misses_checked": sum(a["exact"]["misses_checked"] for a in cached.values()),
        "mismatches": sum(a["exact"]["misses_mismatches"] for a in cached.values()),
        "nondeterministic": sum(a["exact"].get("misses_nondeterministic", 0) for a in cached.values()),
    }
    unbudgeted = {name: a for name, a in cached.items() if Arm.parse(name).budget is None}
    oracle = "state_oracle_hit_rate" if match == "state" else "oracle_hit_rate"
    gaps = {name: round(100 * (a.get(oracle, 0) - a.get("service_hit_rate", 0)), 3) for name, a in unbudgeted.items()}
    issued_gaps = {
        name: round(100 * (a["issued_oracle_hit_rate"] - a.get("service_hit_rate", 0)), 3)
        for name, a in unbudgeted.items()
    }
    out["hit_rate_equals_oracle"] = {
        "oracle": oracle,
        "met": all(abs(g) < HIT_VS_ORACLE_POINTS for g in gaps.values()),
        "gap_points": gaps,
        "gap_points_to_issued_oracle": issued_gaps,
    }
    if match == "state":
        out["hit_rate_above_longest_prefix_oracle"] = {
            name: round(100 * (a.get("service_hit_rate", 0) - a.get("oracle_hit_rate", 0)), 3)
            for name, a in unbudgeted.items()
        }
    losses = {}
    for name, a in cached.items():
        arm = Arm.parse(name)
        if arm.budget is not None and arm.mode in arms:
            base = arms[arm.mode]
            losses[name] = {
                "hit_rate_loss_points": round(100 * (base["hit_rate"] - a["hit_rate"]), 3),
                "tool_time_s": a["tool_time_s"],
                "tool_time_s_no_budget": base["tool_time_s"],
                "p50_ms": a["latency_ms"]["p50"],
                "p50_ms_no_budget": base["latency_ms"]["p50"],
            }
    if losses:
        out["budget_loss"] = losses
    if "nocache" in arms:
        base = arms["nocache"]["latency_ms"]
        speedups = {
            name: {
                "p50_x": round(base["p50"] / a["latency_ms"]["p50"], 2) if a["latency_ms"]["p50"] else None,
                "p95_x": round(base["p95"] / a["latency_ms"]["p95"], 2) if a["latency_ms"]["p95"] else None,
                "step_x": round(arms["nocache"]["step_s_total"] / a["step_s_total"], 2) if a["step_s_total"] else None,
            }
            for name, a in cached.items()
        }
        entry: dict[str, Any] = {"speedup_vs_nocache": speedups}
        if workload == "terminal":
            entry["met"] = any((s["p50_x"] or 0) >= MEDIAN_SPEEDUP for s in speedups.values())
            entry["target_x"] = MEDIAN_SPEEDUP
        out["median_latency_reduction"] = entry
    lookups = {name: a["miss_lookup_ms"]["p95"] for name, a in cached.items() if "miss_lookup_ms" in a}
    if lookups:
        # The target is on the lookup a miss pays before its tool runs; the whole overhead (the
        # lookup, the wait for the previous miss's record and snapshot that thinking did not
        # cover, replays' records) is reported next to it.
        def p95(field: str) -> dict[str, float]:
            return {name: a[field]["p95"] for name, a in cached.items() if field in a}

        out["miss_lookup_p95_ms"] = {
            "met": all(v < MISS_OVERHEAD_P95_MS for v in lookups.values()),
            "lookup_p95_ms": lookups,
            "service_share_p95_ms": p95("miss_lookup_server_ms"),
            "whole_overhead_p95_ms": p95("miss_overhead_ms"),
            "background_wait_p95_ms": p95("miss_background_wait_ms"),
            "target_ms": MISS_OVERHEAD_P95_MS,
        }
    costs = {name: a["verification"]["cost_pct"] for name, a in cached.items() if "verification" in a}
    if costs:
        entry = {"cost_pct": costs, "target_pct": VERIFICATION_COST_PCT}
        if workload == "terminal":
            entry["met"] = all(c is not None and c <= VERIFICATION_COST_PCT for c in costs.values())
        out["verification_cost"] = entry
    return out


def fault_summary(replay: Replay, arms: dict[str, dict[str, Any]], issued: dict[str, IssuedOracle]) -> dict[str, Any]:
    """The fault arm's figures per cached arm: wrong answers (results that differ from the fresh
    execution of the same history), hits the known-state rule forbids, the service's divergences,
    and what the faults cost in hit rate (points) against the no-fault oracle: the rule's share
    (no-fault oracle - the rule's oracle) and the rest (the rule's oracle - the hit rate)."""
    out: dict[str, Any] = {"plan": replay.config.faults.describe(), "restarts": replay.restarts, "arms": {}}
    for name, a in arms.items():
        if Arm.parse(name).mode == "nocache":
            continue
        exact = a["exact"]
        hit, rule, no_fault = a["hit_rate"], a["issued_oracle_hit_rate"], a["no_fault_oracle_hit_rate"]
        out["arms"][name] = {
            "wrong_hits": exact["hits_mismatches"],
            "wrong_misses": exact["misses_mismatches"],
            "after_unknown_state": {
                key.removeprefix("after_event_"): exact[key] for key in EXACT_KEYS if key.startswith("after_event_")
            },
            # Hits after an unknown-state event from the shared graph: the known-state rule forbids them.
            "forbidden_hits": a["forbidden_hits"],
            "forbidden_hit_examples": issued[name].forbidden_examples,
            "not_compared": exact["not_compared"],
            "planned": dict(replay.faults_planned[name]),
            **a["faults"],
            "divergences": replay.divergences.get(name),
            "hit_rate": round(hit, 4),
            "issued_oracle_hit_rate": round(rule, 4),
            "no_fault_oracle_hit_rate": round(no_fault, 4),
            "cost_points": {
                "vs_no_fault_oracle": round(100 * (no_fault - hit), 3),
                "known_state_rule": round(100 * (no_fault - rule), 3),
                "beyond_rule": round(100 * (rule - hit), 3),
            },
            # Calls made less the calls the service's stats count: counters it had not flushed when
            # it was killed are lost, and the calls of a rollout off the shared graph are not looked
            # up in client mode (positive); a call answered with an error and sent again counts
            # twice (negative).
            "calls_minus_service_counted": a["calls"] - a["service_calls"] if "service_calls" in a else None,
        }
    return out


def miss_vs_direct(by_arm: dict[str, list[EpochRun]]) -> dict[str, Any]:
    """Per cached arm, its misses against the direct calls of the same run (the no-cache arm's, in
    its own containers): `median_miss_ms` and `median_direct_ms` (all the no-cache arm's calls),
    their difference `medians_diff_ms`; `paired_median_diff_ms`, the median over the misses of
    (the miss - the no-cache arm's run of the same call: epoch, task, rollout, position), the
    issue's own measure, and `paired_median_exec_diff_ms` the same of the miss's observed run
    alone (its exec and processes phases: tool-server mode); `tool_time_vs_bound`, the arm's tool time over (1 - its hit rate) x the
    no-cache arm's tool time. Empty without a no-cache arm."""
    direct = {
        (s.epoch, s.task, s.rollout, s.position): s.latency_ms for run in by_arm.get("nocache", []) for s in run.calls
    }
    if not direct:
        return {}
    direct_tool_s = sum(direct.values()) / 1000
    out = {}
    for name, runs in by_arm.items():
        if Arm.parse(name).mode == "nocache":
            continue
        calls = [s for run in runs for s in run.calls]
        misses = [s for s in calls if s.cached is False]
        pairs = [(s, direct[k]) for s in misses if (k := (s.epoch, s.task, s.rollout, s.position)) in direct]
        paired = [s.latency_ms - d for s, d in pairs]
        # tool-server mode: the observed run itself (exec, processes) against the direct run
        exec_paired = [
            s.phases_ms.get("exec", 0.0) + s.phases_ms.get("processes", 0.0) - d for s, d in pairs if s.phases_ms
        ]
        median_miss = percentile([s.latency_ms for s in misses], 50, 3)
        median_direct = percentile(list(direct.values()), 50, 3)
        bound_s = (1 - sum(1 for s in calls if s.cached) / len(calls)) * direct_tool_s if calls else 0.0
        out[name] = {
            "misses": len(misses),
            "median_miss_ms": median_miss,
            "median_direct_ms": median_direct,
            "medians_diff_ms": round(median_miss - median_direct, 3) if median_miss is not None else None,
            "paired_median_diff_ms": percentile(paired, 50, 3),
            "paired_p95_diff_ms": percentile(paired, 95, 3),
            "paired_median_exec_diff_ms": percentile(exec_paired, 50, 3),
            "tool_time_vs_bound": round(tool_time_s(calls) / bound_s, 3) if bound_s else None,
        }
    return out


def build_report(
    replay: Replay,
    *,
    workload: str,
    config: dict[str, Any],
    started_at: dt.datetime,
    seconds: float,
    server: dict[str, Any],
) -> dict[str, Any]:
    by_arm: dict[str, list[EpochRun]] = {}
    for run in replay.runs:
        by_arm.setdefault(run.arm, []).append(run)
    epochs = []
    faults = replay.config.faults is not None
    issued = {name: issued_oracle(runs) for name, runs in by_arm.items()}
    for epoch in range(replay.config.epochs):
        epochs.append(
            {
                "epoch": epoch,
                "arms": {
                    run.arm: epoch_metrics(run, issued[run.arm], faults) for run in replay.runs if run.epoch == epoch
                },
            }
        )
    arms = {name: arm_summary(runs, issued[name], faults) for name, runs in by_arm.items()}
    return {
        "workload": workload,
        "started_at": started_at.isoformat(),
        "seconds": round(seconds, 1),
        "config": config,
        "workload_info": replay.workload.describe(),
        "workload_figures": replay.workload.figures(replay.runs),
        "server": server,
        "tasks": [task.name for task in replay.tasks],
        "arms": [{"name": a.name, "mode": a.mode, "budget": a.budget} for a in replay.config.arms],
        "epochs": epochs,
        "summary": arms,
        "per_tool": replay.per_tool,
        "mismatch_examples": replay.mismatch_examples,
        "divergences": replay.divergences,
        **({"faults": fault_summary(replay, arms, issued)} if faults else {}),
        "targets": targets(workload, arms, config.get("match")),
        "miss_vs_direct": miss_vs_direct(by_arm),
        "load_avg": {"end": [round(x, 2) for x in os.getloadavg()]},
        "plots": [],
    }


def write_report(report: dict[str, Any], out_dir: Path, stamp: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{report['workload']}-{stamp}.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    return path


def headline(report: dict[str, Any]) -> str:
    """A markdown table: one row per epoch and arm."""
    lines = [
        "| epoch | arm | hit rate | oracle (service / issued) | state oracle | p50 ms | p95 ms | step s | "
        "slowest rollout s | sandboxes | snapshots live (bytes) | hits checked / mismatched |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for epoch in report["epochs"]:
        for name, m in epoch["arms"].items():
            service = m.get("service", {})
            oracle = (
                f"{100 * m['oracle_hit_rate']:.1f} / {100 * m['issued_oracle_hit_rate']:.1f} %"
                if "oracle_hit_rate" in m
                else "-"
            )
            hit = f"{100 * m['service_hit_rate']:.1f} %" if "service_hit_rate" in m else "-"
            state = service.get("state_oracle_hit_rate")
            state = "-" if state is None else f"{100 * state:.1f} % ({service.get('state_hits', 0)} state-keyed hits)"
            # Client mode registers no snapshot sizes: its bytes are those the harness's envs froze.
            size = service.get("snapshot_bytes_live") or m["sandboxes"].get("snapshot_bytes", 0)
            snaps = f"{service.get('snapshots_live', 0)} ({_bytes(size)})" if service else "-"
            started = int(m["sandboxes"].get("starts", 0) + m["sandboxes"].get("resume_forks", 0))
            exact = f"{m['exact'].get('hits_checked', 0)} / {m['exact'].get('hits_mismatches', 0)}" if service else "-"
            lines.append(
                f"| {epoch['epoch']} | {name} | {hit} | {oracle} | {state} | {m['latency_ms']['p50']:.1f} | "
                f"{m['latency_ms']['p95']:.1f} | {m['step_s']:.1f} | {m['slowest_rollout_s']:.1f} | "
                f"{started} | {snaps} | {exact} |"
            )
    return "\n".join(lines)


def breakdown(report: dict[str, Any]) -> str:
    """A few lines over all epochs: where a tool-server miss's time goes and what verification
    costs it, per server arm; the verify step's and the final verification's calls, hits and tool
    time, per arm (workloads that label them)."""
    lines = []
    for name, a in report["summary"].items():
        if "miss_phases_ms" in a:
            phases = a["miss_phases_ms"]
            went = ", ".join(
                f"{p} {f['mean']:.1f} ({f['total_s']:.1f})" for p, f in phases.items() if f["misses"] and f["total_s"]
            )
            v = a["verification"]
            lines.append(f"{name}: {v['misses']} misses, phase mean ms (total s): {went}")
            cost = "-" if v["cost_pct"] is None else f"+{v['cost_pct']:.1f} %"
            lines.append(
                f"{name}: verification (verify + fingerprint) {cost} on the median miss "
                f"({v['median_miss_ms']:.1f} ms against {v['median_miss_unverified_ms']:.1f} ms without; "
                f"its median {v['median_verification_ms']:.1f} ms)"
            )
    steps = {name: a for name, a in report["summary"].items() if f"{VERIFY_STEP}_step" in a}
    for field, label in ((f"{VERIFY_STEP}_step", "verify step"), (f"final_{VERIFY_STEP}", "final verify")):
        if steps:
            lines.append(
                f"{label} (calls, hits, tool time): "
                + " | ".join(
                    f"{name} {a[field]['calls']}, {a[field]['hits']}, {a[field]['tool_time_s']:.1f} s"
                    for name, a in steps.items()
                )
            )
    return "\n".join(lines)


def fault_headline(report: dict[str, Any]) -> str:
    """A markdown table of the fault arm: one row per cached arm."""
    lines = [
        "| arm | faults planned / fired | restarts | wrong hits / misses (after an unknown state) | "
        "forbidden hits | divergences | hit rate | oracle: rule / no fault | cost points: rule + rest |",
        "|---|---|---:|---|---:|---:|---:|---|---|",
    ]
    for name, f in report["faults"]["arms"].items():
        after = f["after_unknown_state"]
        restarts = sum(1 for r in report["faults"]["restarts"] if r["arm"] == name)
        divergences = "-" if f["divergences"] is None else f["divergences"].get("count", "-")
        cost = f["cost_points"]
        lines.append(
            f"| {name} | {_kinds(f['planned'])} / {_kinds(f['fired'])} | {restarts} | "
            f"{f['wrong_hits']} / {f['wrong_misses']} ({after['hits_mismatches']} / "
            f"{after['misses_mismatches']}) | {f['forbidden_hits']} | {divergences} | "
            f"{100 * f['hit_rate']:.1f} % | {100 * f['issued_oracle_hit_rate']:.1f} / "
            f"{100 * f['no_fault_oracle_hit_rate']:.1f} % | {cost['vs_no_fault_oracle']:.1f}: "
            f"{cost['known_state_rule']:.1f} + {cost['beyond_rule']:.1f} |"
        )
    return "\n".join(lines)


def _kinds(counts: dict[str, int]) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items())) or "none"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
