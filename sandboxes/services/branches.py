"""Branching in tool-server mode: n new rollouts continue from a known state of the graph
(cache/services/branches.py says which states can be branched), each with a sandbox in that state
by its first call that needs one.

The point's state needs a snapshot: when it has none, the first branch's sandbox is made as a miss
after the point would make it (materialize.rollout_sandbox: a ready pre-fork or a fork of the
nearest snapshot along the history, else a fresh sandbox, then a replay of the calls past it,
verified against the state fingerprint the point's node recorded) and snapshotted there, so n
branches pay for at most one replay. The other branches' sandboxes are made by their first misses,
as any miss makes one: a ready pre-fork of that snapshot first (one warms from the request on),
else a fork of it. The answer waits for none of them, and a branch whose calls all hit needs none:
sandboxes made ahead for every branch sat idle for most of them (docs/lab/tree-search-replay.md).
A state with live processes is snapshotted only by a runtime that keeps them
(docs/design/state.md); otherwise each branch replays before the answer, side by side. Branches
count against the project's grant of live sandboxes: a request for more than it has room for is
refused (429) before any rollout is made."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from django.db import connections, transaction

from cache.models import Node, Snapshot, Task
from cache.notfound import unknown_task
from cache.services import history_resume, lease_release
from cache.services.branches import BranchPoint, branch_ids, branch_point, rollouts_branch
from cache.tcg.records import CallContext
from sandboxes.handles import backend_named, is_managed
from sandboxes.models import Sandbox

from .materialize import Phases, Run, retire, rollout_sandbox
from .misses import snapshot_take
from .pools import SandboxQuotaExceeded, idle_deadline, prefork_if_room, room_for

PARALLEL_BRANCHES = 4  # branch sandboxes made at once, after the first
ON_MISS = "on_miss"  # a branch's `how` when its first miss makes its sandbox (none before the answer)


@dataclass(frozen=True, slots=True)
class Branch:
    rollout_id: str
    ready_ms: float | None  # until its sandbox was in the point's state (None: no sandbox made)
    how: str  # how the sandbox got there (MaterializationStat.How), ON_MISS, "" without one


@dataclass(frozen=True, slots=True)
class Branches:
    point: BranchPoint
    branches: list[Branch]


def branches_open(
    *,
    task_id: str,
    rollout: str | None,
    step: int | None,
    node_id: int | None,
    count: int,
    rollout_ids,
    epoch: int,
    tokens=None,
    trajectory_refs=None,
) -> Branches:
    task = Task.objects.select_related("project").filter(pk=task_id).first()
    if task is None:
        raise unknown_task(task_id)
    point = branch_point(task_id=task_id, rollout=rollout, step=step, node_id=node_id)
    managed = is_managed(task.env.get("backend", "external"))
    if managed:
        with transaction.atomic():  # (a count, not a reservation: each sandbox is checked again as it is made)
            room = room_for(task)
        if room is not None and room < count:
            raise SandboxQuotaExceeded(
                f"{count} branches need {count} sandboxes; the project has room for {room} more.",
                details={"requested": count, "room": room},
            )
    rows = rollouts_branch(
        task_id=task_id,
        point=point,
        rollout_ids=rollout_ids or branch_ids(point, count),
        epoch=epoch,
        tokens=tokens,
        trajectory_refs=trajectory_refs,
    )
    if not managed:  # client mode: the trainer's environments follow the histories
        return Branches(point, [Branch(row.rollout_id, None, "") for row in rows])
    if point.node_id is None:  # the root: a fresh sandbox is its state, started by each branch's first miss
        return Branches(point, [Branch(row.rollout_id, None, ON_MISS) for row in rows])
    backend = backend_named(task.env["backend"])
    snapshot = _resumable_snapshot(point.node_id)
    made = []
    if snapshot is None:  # the first branch reaches the state and snapshots it, where a snapshot can stand for it
        made.append(_prepared(task, backend, rows[0], point, first=True))
        snapshot = _resumable_snapshot(point.node_id)
    rest = rows[len(made) :]
    if snapshot is not None:
        # The others' sandboxes are forks of it, made by their first misses (a ready pre-fork
        # first, one of which warms from now on): a branch whose calls all hit needs none, and the
        # answer waits for none.
        if rest:
            prefork_if_room(task_id=task.pk, snapshot_id=snapshot)
        return Branches(point, [*made, *(Branch(row.rollout_id, None, ON_MISS) for row in rest)])
    # No snapshot stands for the state (live processes, a runtime that cannot keep them): each
    # branch reaches it by replay, side by side (the engine bounds its concurrent starts).
    with ThreadPoolExecutor(max_workers=min(len(rest), PARALLEL_BRANCHES) or 1) as pool:
        replayed = list(pool.map(lambda row: _in_thread(_prepared, task, backend, row, point, first=False), rest))
    return Branches(point, [*made, *replayed])


def _resumable_snapshot(node_id: int) -> int | None:
    """The node's live snapshot, if a fork of it is the node's state (its processes included)."""
    row = (
        Snapshot.objects.filter(node_id=node_id, status=Snapshot.Status.LIVE)
        .values_list("pk", "keeps_processes", "node__live_processes")
        .first()
    )
    return row[0] if row is not None and (row[1] or not row[2]) else None


def _in_thread(work, *args, **kwargs):
    try:
        return work(*args, **kwargs)
    finally:
        connections.close_all()  # this thread's


def _prepared(task, backend, rollout, point: BranchPoint, *, first: bool) -> Branch:
    """The branch's sandbox, leased to it in the point's state; the first one snapshotted there if
    the state has no snapshot yet."""
    started = time.perf_counter()
    context = CallContext(point.history, None, rollout.rollout_id, rollout.epoch, None)
    answer = history_resume(task_id=task.pk, history=point.history, rollout_id=rollout.rollout_id)
    restore_ms = None
    try:
        run = rollout_sandbox(task, backend, rollout, context, answer, Phases())
        restore_ms = run.restore_ms
    finally:
        if answer.lease_id:
            lease_release(lease_id=answer.lease_id, restore_ms=restore_ms)
    if run.diverged:  # the recorded state could not be reached: its first call finds out again, and detaches
        retire(run.row, f"diverged from its history: {run.diverged}")
        return Branch(rollout.rollout_id, None, "")
    Sandbox.objects.filter(pk=run.row.pk).update(applied=len(point.history), lease_expires_at=idle_deadline())
    ready_ms = (time.perf_counter() - started) * 1000
    if first and _snapshot_wanted(run, point, answer):
        # A replay's (its forks are verified as replays are); the other branches fork it now, so no
        # pre-fork is started for it.
        snapshot_take(run, point.node_id, exact=False, prefork=False)
    return Branch(rollout.rollout_id, ready_ms, run.how)


def _snapshot_wanted(run: Run, point: BranchPoint, answer) -> bool:
    """The point's state has no snapshot, and a snapshot of this sandbox would be the state."""
    if point.node_id is None:
        return False  # the root: a fresh sandbox is the state
    resume = answer.match.resume
    if resume is not None and resume.node_id == point.node_id:
        return False
    processes = Node.objects.filter(pk=point.node_id).values_list("live_processes", flat=True).first()
    return not processes or run.sandbox.keeps_processes
