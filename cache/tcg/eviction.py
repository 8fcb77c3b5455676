"""Eviction scoring: which live snapshots to drop first when a task is over its budget.

Results are small and stay cached; only snapshots (and the sandboxes behind them) are evicted.
"""

from __future__ import annotations

from dataclasses import dataclass

HIT_HALF_LIFE_S = 3600.0


@dataclass(frozen=True, slots=True)
class SnapshotCandidate:
    snapshot_id: int
    hit_count: int  # hits on the node and its subtree's direct children
    children: int
    depth: int
    rebuild_ms: float  # cost to rebuild the state from the nearest other snapshot or root
    idle_s: float  # seconds since the node last hit or was created
    leased: bool = False
    pinned: bool = False


def reuse_score(candidate: SnapshotCandidate) -> float:
    """Expected value of keeping the snapshot: likely reuse times the cost it saves.

    Recent hits and many children make reuse likely; depth makes a state more specific;
    idleness decays the evidence with a one-hour half-life.
    """
    decay = 0.5 ** (candidate.idle_s / HIT_HALF_LIFE_S)
    reuse = (1.0 + candidate.hit_count + candidate.children) * decay / (1.0 + candidate.depth)
    return reuse * (1.0 + candidate.rebuild_ms)


def eviction_order(candidates: list[SnapshotCandidate], over_budget: int) -> list[int]:
    """The ids of up to `over_budget` snapshots to evict, least valuable first.

    Leased and pinned snapshots are never chosen, so the result may be shorter than asked.
    """
    if over_budget <= 0:
        return []
    evictable = [c for c in candidates if not c.leased and not c.pinned]
    evictable.sort(key=lambda c: (reuse_score(c), c.snapshot_id))
    return [c.snapshot_id for c in evictable[:over_budget]]
