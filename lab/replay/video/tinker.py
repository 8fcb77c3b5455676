"""The Tinker part of the video replay: one video's group through tinker-cookbook's own rollout
loop, uncached and through tvclient.integrations.tinker, in the tinker venv
(lab/frameworks/video_tinker.py; the venv is built on first use, lab/frameworks/venvs.py).

The replay's harness runs in this venv, which has Django and no tinker-cookbook; the Tinker
venv has the cookbook and no Django. So the replay's client arm runs tvclient's
ToolCallExecutor, and this check runs the same video tools and the same policy's rollouts
through the cookbook's `do_group_rollout`, once without tvcache and `passes` times through
TVCacheEnvGroupBuilder, TVCacheSandbox and TVCacheTool, and says whether every pass produced
the same bytes.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from typing import Any

from lab.frameworks.venvs import ROOT, Framework

DRIVER = "lab.frameworks.video_tinker"


class TinkerCheckFailed(RuntimeError):
    pass


def tinker_group(
    *, url: str, token: str, seed: int, group_size: int, latency_scale: float, passes: int = 2, timeout_s: float = 1800
) -> dict[str, Any]:
    """The driver's summary (see its docstring), plus `identical`: every cached pass produced
    what the uncached pass did."""
    args = [
        "-m",
        DRIVER,
        "--seed",
        str(seed),
        "--group-size",
        str(group_size),
        "--passes",
        str(passes),
        "--latency-scale",
        str(latency_scale),
        "--task-id",
        f"video-tinker-{uuid.uuid4().hex[:12]}",
    ]
    try:  # builds the venv on first use
        done = Framework.named("tinker").run(
            args, env={"TVCACHE_URL": url, "TVCACHE_TOKEN": token}, timeout=timeout_s, cwd=ROOT
        )
    except (RuntimeError, subprocess.SubprocessError) as exc:
        raise TinkerCheckFailed(f"the tinker venv: {exc} (--tinker-group 0 skips the Tinker part)") from exc
    if done.returncode != 0:
        raise TinkerCheckFailed(f"{DRIVER} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    summary = json.loads(done.stdout)
    cached = [p for p in summary["passes"] if p["mode"] == "cached"]
    summary["identical"] = bool(cached) and all(p["identical_to_uncached"] for p in cached)
    return summary


def tinker_line(summary: dict[str, Any]) -> str:
    """One line for the command's output."""
    passes = []
    for p in summary["passes"]:
        executor = p.get("executor", {})
        counts = f", {executor.get('hits', 0)} hits / {executor.get('misses', 0)} misses" if executor else ""
        same = "" if "identical_to_uncached" not in p else (" identical" if p["identical_to_uncached"] else " DIFFERS")
        passes.append(f"{p['mode']} tool {p['tool_s']:.1f} s{counts}{same}")
    return (
        f"tinker ({summary['framework']}, do_group_rollout, {summary['video']}, group of {summary['group_size']}, "
        f"{summary['calls']} calls): " + "; ".join(passes)
    )
