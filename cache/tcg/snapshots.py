"""Selective snapshotting: snapshot after a write only when it pays for itself."""

from __future__ import annotations

from dataclasses import dataclass

MOVING_AVERAGE_WEIGHT = 0.2


@dataclass(frozen=True, slots=True)
class SnapshotCosts:
    """Measured per backend as moving averages, in milliseconds."""

    snapshot_ms: float
    restore_ms: float


def snapshot_wanted(
    *,
    mutates: bool,
    replay_cost_ms: float,
    costs: SnapshotCosts,
    live_processes: int = 0,
    keeps_processes: bool = False,
) -> bool:
    """Snapshot when re-executing the path since the nearest snapshot costs more than taking
    plus restoring one. Read-only calls never change the state, so never need one; nor does a
    state with live processes where the snapshot would not keep them: no fork could use it."""
    if live_processes and not keeps_processes:
        return False
    return mutates and replay_cost_ms > costs.snapshot_ms + costs.restore_ms


def snapshot_after_ms(*, replay_cost_ms: float, costs: SnapshotCosts) -> float:
    """How long a state-changing call must run, after a path whose replay since its nearest
    snapshot costs `replay_cost_ms`, for `snapshot_wanted` to hold after it."""
    return max(0.0, costs.snapshot_ms + costs.restore_ms - replay_cost_ms)


def moving_average(previous: float | None, sample: float, weight: float = MOVING_AVERAGE_WEIGHT) -> float:
    if previous is None:
        return sample
    return (1 - weight) * previous + weight * sample
