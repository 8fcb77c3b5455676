"""PNG plots of a replay report (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)

MAX_TOOLS = 25


def write_plots(report: dict[str, Any], out_dir: Path, stamp: str) -> list[str]:
    base = out_dir / f"{report['workload']}-{stamp}"
    paths = [
        _hit_rate(report, Path(f"{base}-hit-rate.png")),
        _latency_cdf(report, Path(f"{base}-latency-cdf.png")),
        _per_tool(report, Path(f"{base}-per-tool.png")),
        _time_saved(report, Path(f"{base}-time-saved.png")),
    ]
    return [str(p) for p in paths]


def _cached_arms(report) -> list[str]:
    return [a["name"] for a in report["arms"] if a["mode"] != "nocache"]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _hit_rate(report, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4))
    epochs = [e["epoch"] for e in report["epochs"]]
    for name in _cached_arms(report):
        rates = [100 * e["arms"][name].get("service_hit_rate", 0) for e in report["epochs"]]
        oracle = [100 * e["arms"][name].get("oracle_hit_rate", 0) for e in report["epochs"]]
        (line,) = ax.plot(epochs, rates, marker="o", label=f"{name} hit rate")
        ax.plot(epochs, oracle, linestyle="--", marker="x", color=line.get_color(), alpha=0.6, label=f"{name} oracle")
    ax.set(
        xlabel="epoch",
        ylabel="hit rate (%)",
        ylim=(0, 100),
        xticks=epochs,
        title=f"{report['workload']}: hit rate per epoch",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _latency_cdf(report, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for arm in report["arms"]:
        quantiles = report["summary"][arm["name"]]["latency_quantiles_ms"]
        if quantiles:
            values = [max(q, 1e-3) for q in quantiles]
            ax.step(values, [i / (len(values) - 1) for i in range(len(values))], where="post", label=arm["name"])
    ax.set_xscale("log")
    ax.set(
        xlabel="tool-call latency (ms, log scale)",
        ylabel="fraction of calls",
        title=f"{report['workload']}: tool-call latency CDF",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _per_tool(report, path: Path) -> Path:
    arms = _cached_arms(report)
    tools = sorted(
        {row["tool"] for name in arms for row in report["per_tool"].get(name, [])},
        key=lambda t: -sum(r["calls"] for n in arms for r in report["per_tool"].get(n, []) if r["tool"] == t),
    )
    tools = tools[:MAX_TOOLS]
    fig, ax = plt.subplots(figsize=(max(6.4, 0.45 * len(tools) * max(len(arms), 1)), 4.4))
    width = 0.8 / max(len(arms), 1)
    for i, name in enumerate(arms):
        rows = {r["tool"]: r for r in report["per_tool"].get(name, [])}
        xs = [j + i * width for j in range(len(tools))]
        ax.bar(xs, [100 * rows.get(t, {}).get("hit_rate", 0) for t in tools], width, label=f"{name} hit rate")
        ax.scatter(
            xs,
            [100 * rows.get(t, {}).get("oracle_hit_rate", 0) for t in tools],
            marker="_",
            s=120,
            color="black",
            zorder=3,
            label="oracle" if i == 0 else None,
        )
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tools))])
    ax.set_xticklabels(tools, rotation=60, ha="right", fontsize=7)
    ax.set(ylabel="hit rate (%)", ylim=(0, 100), title=f"{report['workload']}: hit rate per tool (all epochs)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _time_saved(report, path: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 4))
    epochs = [e["epoch"] for e in report["epochs"]]
    arms = [a["name"] for a in report["arms"]]
    width = 0.8 / max(len(arms), 1)
    for i, name in enumerate(arms):
        xs = [x + i * width for x in epochs]
        left.bar(xs, [e["arms"][name]["tool_time_s"] for e in report["epochs"]], width, label=name)
        right.bar(xs, [e["arms"][name]["step_s"] for e in report["epochs"]], width, label=name)
    for ax, what in ((left, "time waiting on tool calls (s, all rollouts)"), (right, "step time (s, wall clock)")):
        ax.set_xticks([x + 0.4 - width / 2 for x in epochs])
        ax.set_xticklabels([str(e) for e in epochs])
        ax.set(xlabel="epoch", ylabel=what)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['workload']}: time with and without the cache")
    return _save(fig, path)
