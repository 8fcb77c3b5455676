"""Pools of ready sandboxes per task: roots (the initial state) and pre-forks of snapshots.

Rows are created WARMING in the request that asks for them; a worker starts or forks the
sandbox (`sandbox_warm`) and marks it READY; a rollout takes one with SKIP LOCKED so that two
rollouts never get the same sandbox.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from cache.models import Snapshot, Task
from cache.services.background import job_enqueue
from dashboard import broadcast
from observability import metrics
from sandboxes.backends.base import SandboxError
from sandboxes.models import Sandbox

from .runtime import backend_named, forget, is_managed, labels, remember, sandbox_config

log = logging.getLogger("tvcache.sandboxes")


def set_state(row: Sandbox, state: str, **fields) -> None:
    for name, value in fields.items():
        setattr(row, name, value)
    row.state = state
    row.save()
    broadcast.pool_changed(task_id=row.task_id, pool=row.pool, sandbox_id=row.pk, state=state)


def pool_request(*, task_id: str, roots: int = 0, snapshot_ids: list[int] = ()) -> list[int]:
    """Create WARMING rows and have workers start them (after this transaction commits)."""
    from workers.tasks import sandbox_warm as warm_task

    task = Task.objects.get(pk=task_id)
    backend = task.env.get("backend", "external")
    rows = [Sandbox(task=task, backend=backend, pool=Sandbox.Pool.ROOT) for _ in range(roots)]
    rows += [Sandbox(task=task, backend=backend, pool=Sandbox.Pool.FORK, snapshot_id=sid) for sid in snapshot_ids]
    created = Sandbox.objects.bulk_create(rows)
    ids = [row.pk for row in created]
    for sandbox_id in ids:
        job_enqueue(warm_task, sandbox_id)
    return ids


WAITING = (Sandbox.State.WARMING, Sandbox.State.READY)


def prefork_if_room(*, task_id: str, snapshot_id: int) -> bool:
    """One ready fork of a snapshot, unless it has one or the task has PREFORKS_PER_TASK waiting:
    idle containers cost memory, and the hottest snapshots get theirs at the next step."""
    waiting = Sandbox.objects.filter(task_id=task_id, pool=Sandbox.Pool.FORK, state__in=WAITING)
    if waiting.filter(snapshot_id=snapshot_id).exists() or waiting.count() >= settings.TVCACHE["PREFORKS_PER_TASK"]:
        return False
    pool_request(task_id=task_id, snapshot_ids=[snapshot_id])
    return True


def sandbox_warm(*, sandbox_id: int) -> None:
    """Start (root) or fork (pre-fork) the sandbox of a WARMING row. Idempotent: a row that is
    not WARMING any more is left alone, and a container made by a crashed attempt is reaped."""
    row = Sandbox.objects.select_related("task", "snapshot").filter(pk=sandbox_id).first()
    if row is None or row.state != Sandbox.State.WARMING:
        return
    backend = backend_named(row.backend)
    started = time.perf_counter()
    try:
        if row.pool == Sandbox.Pool.FORK:
            snapshot = row.snapshot
            if snapshot is None or snapshot.status != Snapshot.Status.LIVE:
                set_state(row, Sandbox.State.FAILED, error="snapshot no longer live")
                return
            sandbox = backend.fork(snapshot.ref, row.task.env, labels=labels(row.task_id, row.pk))
        else:
            sandbox = backend.start(row.task.env, labels=labels(row.task_id, row.pk))
    except SandboxError as exc:
        set_state(row, Sandbox.State.FAILED, error=f"{exc.code}: {exc.message}")
        return
    remember(backend, sandbox)
    with transaction.atomic():
        current = Sandbox.objects.select_for_update().get(pk=row.pk)
        if current.state != Sandbox.State.WARMING:  # stopped meanwhile: do not leak the sandbox
            sandbox.stop()
            return
        set_state(current, Sandbox.State.READY, ref=sandbox.sandbox_id, ready_at=timezone.now(),
                  start_ms=(time.perf_counter() - started) * 1000)
    metrics.sandbox_started(backend=row.backend, forked=row.pool == Sandbox.Pool.FORK, path="pool", ms=current.start_ms)


def sandbox_acquire(*, task_id: str, snapshot_id: int | None, rollout_pk: int) -> Sandbox | None:
    """Take a READY sandbox of the pool (a root, or a fork of `snapshot_id`) for a rollout."""
    pool = Q(pool=Sandbox.Pool.FORK, snapshot_id=snapshot_id) if snapshot_id else Q(pool=Sandbox.Pool.ROOT)
    with transaction.atomic():
        row = (Sandbox.objects.select_for_update(skip_locked=True)
               .filter(pool, task_id=task_id, state=Sandbox.State.READY).order_by("pk").first())
        if row is None:
            return None
        set_state(row, Sandbox.State.LEASED, rollout_id=rollout_pk, lease_expires_at=idle_deadline())
    return row


def idle_deadline(*, busy: bool = False):
    """When a leased sandbox left idle is reaped; `busy`: a call runs in it now, so past the
    longest call a tool may make as well (a call is never reaped mid-run)."""
    longest = sandbox_config().docker.max_timeout_s if busy else 0.0
    return timezone.now() + timedelta(seconds=settings.TVCACHE["ROLLOUT_IDLE_S"] + longest)


def sandbox_stop(*, sandbox_id: int) -> bool:
    """Stop a sandbox and mark it STOPPED. Idempotent."""
    with transaction.atomic():
        row = Sandbox.objects.select_for_update().filter(pk=sandbox_id).first()
        if row is None or row.state == Sandbox.State.STOPPED:
            return False
        set_state(row, Sandbox.State.STOPPING, rollout=None)
    if row.ref:
        try:
            backend_named(row.backend).remove_sandbox(row.ref)
        except SandboxError as exc:  # engine down: the orphan reaper finishes the job later
            log.warning("could not remove sandbox %s: %s", row.ref, exc)
        forget(row.backend, row.ref)
    set_state(row, Sandbox.State.STOPPED, stopped_at=timezone.now())
    return True


def step_announce(*, task_ids: list[str], rollouts_per_task: int) -> dict[str, dict[str, int]]:
    """Before a training step: fill each managed task's root pool up to one sandbox per announced
    rollout, and pre-fork its hottest live snapshots (one copy each, as many as rollouts)."""
    planned = {}
    for task in Task.objects.filter(pk__in=task_ids):
        if not is_managed(task.env.get("backend", "external")):
            continue
        waiting = Sandbox.objects.filter(task=task, state__in=WAITING)
        roots = max(0, rollouts_per_task - waiting.filter(pool=Sandbox.Pool.ROOT).count())
        room = max(0, min(rollouts_per_task, settings.TVCACHE["PREFORKS_PER_TASK"])
                   - waiting.filter(pool=Sandbox.Pool.FORK).count())
        hot = list(
            Snapshot.objects.filter(task=task, status=Snapshot.Status.LIVE, owner=Snapshot.Owner.SERVICE)
            .annotate(waiting=Count("forks", filter=Q(forks__state__in=WAITING)))
            .filter(waiting=0).order_by("-node__hit_count", "-node__depth").values_list("pk", flat=True)[:room]
        )
        pool_request(task_id=task.pk, roots=roots, snapshot_ids=hot)
        planned[task.pk] = {"roots": roots, "forks": len(hot)}
    return planned
