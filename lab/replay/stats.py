"""What the service says of each cached arm's tasks: per epoch (calls, hits, oracle hits,
snapshots), sandboxes started, and per tool at the end of the run, with its divergences."""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from tvclient import TVCacheClient

from .arms import Arm, ArmTasks
from .faults import divergence_count
from .restarts import send

log = logging.getLogger("tvcache.replay")

STATS_SETTLE_S = 0.6  # over twice the service's default counter flush interval (0.25 s)


class ServiceStats:
    def __init__(self, client: TVCacheClient, arm_tasks: ArmTasks):
        self.client = client
        self.arm_tasks = arm_tasks

    def _read(self, read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """What the service answers `read`. Right after the fault arm's restart the client may still
        hold the service for down (its rollouts' requests failed; it probes again later and fails
        fast meanwhile): the read is sent again until the service answers (restarts.send)."""
        answer, _, error, _ = send(read, again=True)
        if error is not None:
            raise RuntimeError(f"the service's figures could not be read: {error}")
        return answer

    def _stats(self, task_id: str) -> dict[str, Any]:
        return self._read(lambda: self.client.stats(task_id))

    def sandboxes_started(self, arm: Arm) -> int:
        """Sandboxes the service started or forked for the arm's tasks (that got running)."""
        return sum(
            self._read(lambda task_id=task_id: self.client.sandboxes(task_id))["started"]
            for task_id in self.arm_tasks.ids(arm)
        )

    def _settled(self, arm: Arm) -> dict[str, dict[str, Any]]:
        """The arm's task stats once they stop moving. Each server process buffers its lookup
        counters for TVCACHE_COUNTER_FLUSH_S (a stats read flushes only the answering process's
        buffer), so two reads STATS_SETTLE_S apart that agree hold every counter of the epoch."""
        pause = STATS_SETTLE_S
        stats = {task_id: self._stats(task_id) for task_id in self.arm_tasks.ids(arm)}
        for _ in range(20):
            time.sleep(pause)
            again = {task_id: self._stats(task_id) for task_id in stats}
            if [s["per_epoch"] for s in again.values()] == [s["per_epoch"] for s in stats.values()]:
                return again
            stats = again
        log.warning("service stats still moving after %.1f s", 20 * pause)
        return stats

    def epoch(self, arm: Arm, epoch: int) -> dict[str, Any]:
        out: Counter[str] = Counter()
        for stats in self._settled(arm).values():
            row = next((r for r in stats["per_epoch"] if r["epoch"] == epoch), {})
            for key in ("calls", "hits", "oracle_hits", "state_hits", "state_oracle_hits", "executed_ms", "saved_ms"):
                out[key] += row.get(key, 0) or 0
            out["snapshots_live"] += stats["snapshots"]["live"]
            out["snapshot_bytes_live"] += stats["snapshots"]["live_bytes"]
            out["snapshots_evicted"] += stats["snapshots"]["evicted"]
            out["nodes"] += stats["nodes"]
        result = dict(out)
        calls = result.get("calls", 0)
        result["hit_rate"] = result.get("hits", 0) / calls if calls else 0.0
        result["oracle_hit_rate"] = result.get("oracle_hits", 0) / calls if calls else 0.0
        result["state_oracle_hit_rate"] = result.get("state_oracle_hits", 0) / calls if calls else 0.0
        return result

    def per_tool(self, arm: Arm) -> tuple[list[dict[str, Any]], dict[str, int] | None]:
        """The arm's figures per tool over the run, and its divergences (None: the service's
        stats carry none)."""
        tools: dict[str, Counter] = defaultdict(Counter)
        divergences: dict[str, int] | None = None
        for task_id in self.arm_tasks.ids(arm):
            stats = self._stats(task_id)
            for row in stats["per_tool"]:
                for key in ("calls", "hits", "oracle_hits", "saved_ms", "executed_ms"):
                    tools[row["tool"]][key] += row.get(key, 0) or 0
            counted = divergence_count(stats)
            if counted is not None:
                divergences = divergences or {}
                for key, n in counted.items():
                    divergences[key] = divergences.get(key, 0) + n
        rows = [
            {
                "tool": tool,
                **dict(c),
                "hit_rate": c["hits"] / c["calls"] if c["calls"] else 0.0,
                "oracle_hit_rate": c["oracle_hits"] / c["calls"] if c["calls"] else 0.0,
            }
            for tool, c in sorted(tools.items())
        ]
        return rows, divergences
