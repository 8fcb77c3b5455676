"""The tree replay's own figures (the report's `tree`), added to a flat replay's report, and their
tables. docs/lab/tree-search-replay.md says what each one means."""

from __future__ import annotations

from collections import Counter
from typing import Any

from lab.figures import percentile

from ..arms import Arm
from ..exactness import EXACT_KEYS
from ..report import tool_time_s
from ..samples import mean
from .harness import TreeReplay
from .samples import BranchReady, TreeRun


def _ms(values: list[float]) -> dict[str, Any]:
    return {
        "p50": percentile(values, 50, 3),
        "p95": percentile(values, 95, 3),
        "mean": round(mean(values), 3) if values else None,
        "n": len(values),
    }


def _ratio(value: float | None, base: float | None) -> float | None:
    return round(value / base, 3) if value and base else None


def tree_report(replay: TreeReplay, *, step_bucket: int) -> dict[str, Any]:
    steps = branch_steps(replay)
    arms = {arm.name: _arm(arm, replay, steps, step_bucket) for arm in replay.config.arms}
    return {
        "shape": replay.config.shape.describe(),
        "step_bucket": step_bucket,
        "arms": arms,
        "by_step": _by_step(replay, steps, step_bucket),
        "epochs": [
            {
                "epoch": epoch,
                "arms": {
                    tree.arm: _throughput(tree_runs=[tree], replay=replay, arm=tree.arm, epochs={epoch})
                    for tree in replay.trees
                    if tree.epoch == epoch
                },
            }
            for epoch in range(replay.config.epochs)
        ],
        "comparison": _comparison(arms),
    }


def branch_steps(replay: TreeReplay) -> dict[tuple[str, int, str], int]:
    """Each branch point's k, the same for every arm: the origin's state-changing calls there as
    a tool-server arm counted them (the service's `step`), else a client arm, else the calls of
    the prefix (the no-cache arm knows no better)."""
    order = {"server": 0, "client": 1, "nocache": 2}
    out: dict[tuple[str, int, str], int] = {}
    for tree in sorted(replay.trees, key=lambda t: order[Arm.parse(t.arm).mode], reverse=True):
        for request in tree.requests:
            key = (request.task, request.epoch, request.origin)
            out[key] = request.step if request.step is not None else request.prefix_calls
    return out


def _bucket(k: int, width: int) -> tuple[int, str]:
    low = k // width * width
    return low, f"{low}-{low + width - 1}"


def _arm(arm: Arm, replay: TreeReplay, steps, step_bucket: int) -> dict[str, Any]:
    trees = [t for t in replay.trees if t.arm == arm.name]
    runs = [r for r in replay.runs if r.arm == arm.name]
    requests = [r for t in trees for r in t.requests]
    branches = [b for t in trees for b in t.branches]
    calls = [s for r in runs for s in r.calls]
    levels: Counter[int] = Counter()
    for tree in trees:
        levels.update(tree.levels)
    exact = {key: sum(r.exact.get(key, 0) for r in runs) for key in EXACT_KEYS}
    errors = [r.error for r in requests if r.error]
    mismatched = [r.history_mismatch for r in requests if r.history_mismatch]
    readiness: dict[str, Any] = {
        "ready": _ms([b.ready_ms for b in branches]),
        "first_call": _ms([b.first_call_ms for b in branches]),
        "first_answer": _ms([b.ready_ms + b.first_call_ms for b in branches]),
    }
    if arm.mode != "nocache":
        readiness["request"] = _ms([r.request_ms for r in requests if r.request_ms is not None])
    if arm.mode == "server":
        readiness["service_ready"] = _ms([b.service_ready_ms for b in branches if b.service_ready_ms is not None])
    hits = [s.latency_ms for s in calls if s.cached]
    held = [ms for t in trees for ms in t.held_ms]
    return {
        "structure": {
            "trajectories": sum(levels.values()),
            "by_level": {str(level): n for level, n in sorted(levels.items())},
            "branch_points": sum(1 for r in requests if not r.error),
            "branches": len(branches),
            "branches_without_miss": sum(1 for b in branches if b.misses == 0),
            "calls": len(calls),
            "branch_errors": len(errors),
        },
        "hit_rate": round(sum(1 for s in calls if s.cached) / len(calls), 4) if calls else 0.0,
        "wrong_answers": exact["hits_mismatches"] + exact["misses_mismatches"],
        "exact": exact,
        "readiness_ms": readiness,
        "materialized": dict(Counter(b.materialized for b in branches if b.materialized)),
        "baseline_ms": {
            "held_sandbox_call_p50": percentile(held, 50, 3),
            "held_sandbox_calls": len(held),
            "hit_p50": percentile(hits, 50, 3),
        },
        "throughput": _throughput(tree_runs=trees, replay=replay, arm=arm.name, epochs=None),
        "history_mismatches": len(mismatched),
        "history_mismatch_examples": mismatched[:5],
        "branch_error_examples": errors[:5],
    }


def _throughput(*, tree_runs: list[TreeRun], replay: TreeReplay, arm: str, epochs: set[int] | None) -> dict[str, Any]:
    runs = [r for r in replay.runs if r.arm == arm and (epochs is None or r.epoch in epochs)]
    calls = [s for r in runs for s in r.calls]
    trajectories = sum(t.trajectories for t in tree_runs)
    sandbox_s = sum(t.sandbox_s for t in tree_runs)
    tool_s = tool_time_s(calls)
    if Arm.parse(arm).mode == "nocache":  # each branch made its own sandbox and replayed its prefix
        branch_s = sum(b.ready_ms for t in tree_runs for b in t.branches) / 1000
    else:  # one request per branch point
        branch_s = sum(r.request_ms or 0.0 for t in tree_runs for r in t.requests) / 1000
    wall_s = sum(t.wall_s for t in tree_runs)
    by_state: Counter[str] = Counter()
    for tree in tree_runs:
        by_state.update(tree.sandbox_s_by_state)
    return {
        "trajectories": trajectories,
        "sandbox_s": round(sandbox_s, 3),
        "sandbox_s_measured": tree_runs[0].sandbox_s_measured if tree_runs else "",
        **({"sandbox_s_by_state": {k: round(v, 3) for k, v in sorted(by_state.items())}} if by_state else {}),
        "trajectories_per_sandbox_s": round(trajectories / sandbox_s, 4) if sandbox_s else None,
        "tool_time_s": tool_s,
        "branch_time_s": round(branch_s, 3),
        "trajectories_per_tool_s": round(trajectories / (tool_s + branch_s), 4) if tool_s + branch_s else None,
        "wall_s": round(wall_s, 3),
        "trajectories_per_s": round(trajectories / wall_s, 4) if wall_s else None,
        "hit_rate": round(sum(1 for s in calls if s.cached) / len(calls), 4) if calls else 0.0,
    }


def _by_step(replay: TreeReplay, steps, width: int) -> list[dict[str, Any]]:
    """Readiness per bucket of k (branch_steps), per arm."""
    buckets: dict[tuple[int, str], dict[str, list[BranchReady]]] = {}
    for tree in replay.trees:
        for branch in tree.branches:
            k = steps.get((branch.task, branch.epoch, branch.origin), branch.prefix_calls)
            buckets.setdefault(_bucket(k, width), {}).setdefault(tree.arm, []).append(branch)
    return [
        {
            "k": label,
            "arms": {
                arm: {
                    "branches": len(branches),
                    "prefix_calls_mean": round(mean([b.prefix_calls for b in branches]), 2),
                    "ready_p50_ms": percentile([b.ready_ms for b in branches], 50, 3),
                    "ready_p95_ms": percentile([b.ready_ms for b in branches], 95, 3),
                    "first_answer_p50_ms": percentile([b.ready_ms + b.first_call_ms for b in branches], 50, 3),
                }
                for arm, branches in sorted(arms.items())
            },
        }
        for (_, label), arms in sorted(buckets.items())
    ]


def _comparison(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each cached arm against the no-cache arm, on the same trees: throughput as a ratio (cached /
    nocache), readiness as a speedup (nocache / cached)."""
    base = arms.get("nocache")
    if base is None:
        return {}
    out = {}
    for name, a in arms.items():
        if name == "nocache":
            continue
        out[name] = {
            "same_trees": a["structure"]["trajectories"] == base["structure"]["trajectories"],
            "trajectories_per_sandbox_s_x": _ratio(
                a["throughput"]["trajectories_per_sandbox_s"], base["throughput"]["trajectories_per_sandbox_s"]
            ),
            "trajectories_per_tool_s_x": _ratio(
                a["throughput"]["trajectories_per_tool_s"], base["throughput"]["trajectories_per_tool_s"]
            ),
            "trajectories_per_s_x": _ratio(
                a["throughput"]["trajectories_per_s"], base["throughput"]["trajectories_per_s"]
            ),
            "ready_p50_speedup_x": _ratio(base["readiness_ms"]["ready"]["p50"], a["readiness_ms"]["ready"]["p50"]),
            "first_answer_p50_speedup_x": _ratio(
                base["readiness_ms"]["first_answer"]["p50"], a["readiness_ms"]["first_answer"]["p50"]
            ),
        }
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def tree_headline(report: dict[str, Any]) -> str:
    """Markdown tables: per arm over all epochs, then readiness by k."""
    tree = report["tree"]
    lines = [
        "| arm | trajectories (branches) | hit rate | wrong answers | ready p50 / p95 ms | first answer p50 / p95 ms "
        "| held-sandbox call p50 ms | hit p50 ms | sandbox-s | trajectories / sandbox-s (x nocache) "
        "| trajectories / tool-s (x nocache) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, a in tree["arms"].items():
        r, t, b = a["readiness_ms"], a["throughput"], a["baseline_ms"]
        x = tree["comparison"].get(name, {})
        hit = "-" if name == "nocache" else f"{100 * a['hit_rate']:.1f} %"
        lines.append(
            f"| {name} | {a['structure']['trajectories']} ({a['structure']['branches']}) | "
            f"{hit} | {a['wrong_answers']} | {_fmt(r['ready']['p50'])} / "
            f"{_fmt(r['ready']['p95'])} | {_fmt(r['first_answer']['p50'])} / {_fmt(r['first_answer']['p95'])} | "
            f"{_fmt(b['held_sandbox_call_p50'])} | {_fmt(b['hit_p50'])} | {t['sandbox_s']:.1f} "
            f"({t['sandbox_s_measured']}) | {_fmt(t['trajectories_per_sandbox_s'], 3)}"
            f"{'' if not x else ' (' + _fmt(x['trajectories_per_sandbox_s_x'], 2) + 'x)'} | "
            f"{_fmt(t['trajectories_per_tool_s'], 3)}"
            f"{'' if not x else ' (' + _fmt(x['trajectories_per_tool_s_x'], 2) + 'x)'} |"
        )
    names = list(tree["arms"])
    lines += [
        "",
        "| k | " + " | ".join(f"{n} ready p50 ms (branches)" for n in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for bucket in tree["by_step"]:
        cells = []
        for name in names:
            a = bucket["arms"].get(name)
            cells.append("-" if a is None else f"{_fmt(a['ready_p50_ms'])} ({a['branches']})")
        lines.append(f"| {bucket['k']} | " + " | ".join(cells) + " |")
    errors = {
        name: a["structure"]["branch_errors"] for name, a in tree["arms"].items() if a["structure"]["branch_errors"]
    }
    mismatches = {name: a["history_mismatches"] for name, a in tree["arms"].items() if a["history_mismatches"]}
    if errors:
        lines.append(f"branch requests that failed: {errors}")
    if mismatches:
        lines.append(f"branch answers whose history differs from the origin's: {mismatches}")
    return "\n".join(lines)
