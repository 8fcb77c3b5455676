"""The video replay's own figures over the run's samples (`Workload.figures`, reported as
`workload_figures`), and the table the command prints.

Per arm: tool time and its speedup against the no-cache arm, wrong answers (cached answers that
differ from the fresh execution of the same history: the exactness check), the service's oracle,
and the tokens its hits served, all of them and those of the tools whose answer a captioning
model generates (a hit spares generating them). A token is 4 characters of the answer as the
policy reads it, rounded up (tools.tokens). The lengths come from the workload's transcript: the
same rollouts run again without latencies (a hit's answer is that one: the check compares them).
Per epoch: the share of rollouts whose policy answered the question right.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..arms import Arm
from ..samples import CallSample, EpochRun


@dataclass(frozen=True)
class Transcript:
    """One task's rollouts of one epoch, run again."""

    tokens: list[list[int]]  # per rollout and call: the answer's length in tokens
    right: list[bool]  # per rollout: whether it answered the question right


def video_figures(
    runs: list[EpochRun], transcript: Callable[[str, int], Transcript], generating: set[str]
) -> dict[str, Any]:
    def length(sample: CallSample) -> int:
        return transcript(sample.task, sample.epoch).tokens[sample.rollout][sample.position]

    by_arm: dict[str, list[EpochRun]] = defaultdict(list)
    for run in runs:
        by_arm[run.arm].append(run)
    base_s = sum(s.latency_ms for run in by_arm.get("nocache", []) for s in run.calls) / 1000
    arms: dict[str, Any] = {}
    hits_per_tool: dict[str, Counter[str]] = defaultdict(Counter)
    for name, arm_runs in by_arm.items():
        samples = [s for run in arm_runs for s in run.calls]
        hits = [s for s in samples if s.cached]
        tool_s = sum(s.latency_ms for s in samples) / 1000
        for sample in hits:
            hits_per_tool[sample.tool][name] += 1
        entry: dict[str, Any] = {
            "calls": len(samples),
            "hits": len(hits),
            "hit_rate": round(len(hits) / len(samples), 4) if samples else 0.0,
            "tool_time_s": round(tool_s, 3),
            "tool_time_speedup_x": round(base_s / tool_s, 2) if tool_s else None,
            "tokens_answered": sum(length(s) for s in samples),
            "tokens_served_by_hits": sum(length(s) for s in hits),
            "generated_tokens_saved": sum(length(s) for s in hits if s.tool in generating),
        }
        if Arm.parse(name).mode != "nocache":
            wrong_hits = sum(run.exact.get("hits_mismatches", 0) for run in arm_runs)
            wrong_misses = sum(run.exact.get("misses_mismatches", 0) for run in arm_runs)
            entry["wrong_answers"] = {"hits": wrong_hits, "misses": wrong_misses, "total": wrong_hits + wrong_misses}
            service = [run.service for run in arm_runs if run.service]
            counted = sum(s.get("calls", 0) for s in service)
            entry["service_hit_rate"] = round(sum(s.get("hits", 0) for s in service) / counted, 4) if counted else None
            entry["oracle_hit_rate"] = (
                round(sum(s.get("oracle_hits", 0) for s in service) / counted, 4) if counted else None
            )
        arms[name] = entry
    return {
        "token_rule": "ceil(characters / 4) of the answer's JSON text, as the policy reads it",
        "generating_tools": sorted(generating),
        "arms": arms,
        "per_tool": _per_tool(by_arm.get("nocache", []), length, hits_per_tool, generating),
        "policy_right_answers": _accuracy(by_arm.get("nocache", []), transcript),
    }


def _per_tool(
    fresh: list[EpochRun],
    length: Callable[[CallSample], int],
    hits: dict[str, Counter[str]],
    generating: set[str],
) -> dict[str, Any]:
    lengths: dict[str, list[int]] = defaultdict(list)
    for run in fresh:
        for sample in run.calls:
            lengths[sample.tool].append(length(sample))
    return {
        tool: {
            "calls_per_arm": len(values),
            "mean_tokens": round(sum(values) / len(values), 1),
            "generates_text": tool in generating,
            "hits": dict(hits.get(tool, {})),
        }
        for tool, values in sorted(lengths.items())
    }


def _accuracy(fresh: list[EpochRun], transcript: Callable[[str, int], Transcript]) -> dict[int, float]:
    out = {}
    for run in sorted(fresh, key=lambda r: r.epoch):
        right = [
            transcript(task, run.epoch).right[rollout] for task, rollout in {(r.task, r.rollout) for r in run.rollouts}
        ]
        out[run.epoch] = round(sum(right) / len(right), 3) if right else 0.0
    return out


def video_table(report: dict[str, Any]) -> str:
    """A markdown table: one row per arm over the run."""
    figures = report["workload_figures"]
    lines = [
        "| arm | calls | hit rate | oracle hit rate (service / issued) | tool time s | tool-time speedup | "
        "wrong answers | tokens served by hits | caption tokens saved |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, a in figures["arms"].items():
        summary = report["summary"][name]
        cached = Arm.parse(name).mode != "nocache"
        oracle = (
            f"{100 * (a['oracle_hit_rate'] or 0):.1f} / {100 * summary['issued_oracle_hit_rate']:.1f} %"
            if cached
            else "-"
        )
        lines.append(
            f"| {name} | {a['calls']} | {100 * a['hit_rate']:.1f} % | {oracle} | {a['tool_time_s']:.1f} | "
            f"{a['tool_time_speedup_x'] or 0:.2f}x | {a['wrong_answers']['total'] if cached else '-'} | "
            f"{a['tokens_served_by_hits']} | {a['generated_tokens_saved']} |"
        )
    right = ", ".join(f"epoch {e}: {100 * v:.0f} %" for e, v in figures["policy_right_answers"].items())
    lines.append("")
    lines.append(f"policy answered right: {right}")
    return "\n".join(lines)
