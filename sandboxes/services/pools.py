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

from accounts.models import Project
from accounts.projects import key_project
from cache import ledger
from cache.models import AuditEntry, Snapshot, Task
from cache.services.admin import action_audited
from core.background import job_enqueue
from core.errors import NotFound, TooManyRequests
from observability import metrics
from sandboxes.backends.base import EngineUnavailable, SandboxError, SnapshotMissing
from sandboxes.backends.base import Sandbox as SandboxHandle
from sandboxes.engines import engine_lost, engine_queue, engines_for, engines_placed
from sandboxes.handles import env_check_granted, forget, is_managed, labels, remember, sandbox_backend, sandbox_config
from sandboxes.models import Sandbox

log = logging.getLogger("tvcache.sandboxes")


def set_state(row: Sandbox, state: str, **fields) -> None:
    for name, value in fields.items():
        setattr(row, name, value)
    row.state = state
    row.save()
    ledger.pool_changed(task_id=row.task_id, pool=row.pool, sandbox_id=row.pk, state=state)


class SandboxQuotaExceeded(TooManyRequests):
    code = "sandbox_quota_exceeded"


def room_for(task: Task) -> int | None:
    """How many more sandboxes the task's project may hold now (its grant of live sandboxes;
    None: no bound). Locks the project's row until the caller's transaction ends: sandboxes made
    at once are counted one after the other."""
    project = (
        Project.objects.select_for_update()
        .filter(pk=task.project_id)
        .values_list("max_live_sandboxes", flat=True)
        .first()
    )
    if project is None:
        return None
    live = (
        Sandbox.objects.filter(task__project_id=task.project_id)
        .exclude(state__in=(Sandbox.State.STOPPED, Sandbox.State.FAILED))
        .count()
    )
    return max(0, project - live)


def sandbox_row(*, task: Task, **fields) -> Sandbox:
    """A new sandbox row of the task, within its project's grant of live sandboxes (else 429
    sandbox_quota_exceeded: its rollouts are told to retry once others end)."""
    with transaction.atomic():
        if room_for(task) == 0:
            raise SandboxQuotaExceeded(
                f"Project '{key_project(task.pk)}' holds as many live sandboxes as it is granted; end rollouts "
                "(DELETE .../rollouts/<id>) or retry shortly.",
                details={"project": key_project(task.pk)},
            )
        return Sandbox.objects.create(task=task, **fields)


def pool_request(*, task_id: str, roots: int = 0, snapshot_ids: list[int] = ()) -> list[int]:
    """Create WARMING rows and have workers start them (after this transaction commits); fewer if
    the project's grant of live sandboxes leaves less room (forks first: they are the hot ones)."""
    with transaction.atomic():
        task = Task.objects.get(pk=task_id)
        room = room_for(task)
        if room is not None:
            snapshot_ids = list(snapshot_ids)[:room]
            roots = max(0, min(roots, room - len(snapshot_ids)))
        backend = task.env.get("backend", "external")
        rows = [
            Sandbox(task=task, backend=backend, engine=engine, pool=Sandbox.Pool.ROOT)
            for engine in engines_for(backend, roots)
        ]
        held = dict(Snapshot.objects.filter(pk__in=snapshot_ids).values_list("pk", "engine"))
        rows += [
            Sandbox(task=task, backend=backend, engine=held.get(sid, ""), pool=Sandbox.Pool.FORK, snapshot_id=sid)
            for sid in snapshot_ids
        ]
        created = Sandbox.objects.bulk_create(rows)
        for row in created:
            job_enqueue("workers.tasks.sandbox_warm", row.pk, near=engine_queue(row.engine))
    return [row.pk for row in created]


def sandbox_launch(row: Sandbox, env: dict, *, snapshot: Snapshot | None = None) -> SandboxHandle:
    """Start the row's sandbox on its engine, or fork `snapshot` there (a fork's engine is its
    snapshot's). A fresh sandbox whose engine cannot be reached goes to the next engine by load
    (the row follows); a fork whose engine cannot be reached raises SnapshotMissing, so that the
    caller starts afresh elsewhere and replays."""
    tried: tuple[str, ...] = ()
    while True:
        try:
            backend = sandbox_backend(row)
            if snapshot is not None:
                return backend.fork(snapshot.ref, env, labels=labels(row.task_id, row.pk))
            return backend.start(env, labels=labels(row.task_id, row.pk))
        except EngineUnavailable as exc:
            engine_lost(row.engine)
            if snapshot is not None:
                raise SnapshotMissing(f"snapshot {snapshot.ref} is on an engine out of reach: {exc.message}") from exc
            tried += (row.engine,)
            others = engines_placed(1, exclude=tried) if row.backend == "docker" else []
            if not others:
                raise
            row.engine = others[0].name
            Sandbox.objects.filter(pk=row.pk).update(engine=row.engine)


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
    row = Sandbox.objects.select_related("task", "task__project", "snapshot").filter(pk=sandbox_id).first()
    if row is None or row.state != Sandbox.State.WARMING:
        return
    started = time.perf_counter()
    try:
        env_check_granted(row.task.env, project=row.task.project)  # grants may have shrunk since the task was put
        if row.pool == Sandbox.Pool.FORK and (row.snapshot is None or row.snapshot.status != Snapshot.Status.LIVE):
            set_state(row, Sandbox.State.FAILED, error="snapshot no longer live")
            return
        sandbox = sandbox_launch(row, row.task.env, snapshot=row.snapshot if row.pool == Sandbox.Pool.FORK else None)
    except SandboxError as exc:
        set_state(row, Sandbox.State.FAILED, error=f"{exc.code}: {exc.message}")
        return
    remember(sandbox_backend(row), sandbox)
    with transaction.atomic():
        current = Sandbox.objects.select_for_update().get(pk=row.pk)
        if current.state != Sandbox.State.WARMING:  # stopped meanwhile: do not leak the sandbox
            sandbox.stop()
            return
        set_state(
            current,
            Sandbox.State.READY,
            ref=sandbox.sandbox_id,
            ready_at=timezone.now(),
            start_ms=(time.perf_counter() - started) * 1000,
        )
    metrics.sandbox_started(backend=row.backend, forked=row.pool == Sandbox.Pool.FORK, path="pool", ms=current.start_ms)


def sandbox_acquire(*, task_id: str, snapshot_id: int | None, rollout_pk: int) -> Sandbox | None:
    """Take a READY sandbox of the pool (a root, or a fork of `snapshot_id`) for a rollout."""
    pool = Q(pool=Sandbox.Pool.FORK, snapshot_id=snapshot_id) if snapshot_id else Q(pool=Sandbox.Pool.ROOT)
    with transaction.atomic():
        row = (
            Sandbox.objects.select_for_update(skip_locked=True)
            .filter(pool, task_id=task_id, state=Sandbox.State.READY)
            .order_by("pk")
            .first()
        )
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
            sandbox_backend(row).remove_sandbox(row.ref)
        except SandboxError as exc:  # engine down: the orphan reaper finishes the job later
            log.warning("could not remove sandbox %s: %s", row.ref, exc)
        forget(row.backend, row.ref)
    set_state(row, Sandbox.State.STOPPED, stopped_at=timezone.now())
    return True


def admin_sandbox_stop(*, actor, sandbox_id: str, task_id: str = "") -> AuditEntry:
    """Stop one sandbox as a staff or maintainer action (audited)."""

    def run() -> dict:
        try:
            stopped = sandbox_stop(sandbox_id=int(sandbox_id))
        except ValueError:
            raise NotFound(f"No sandbox '{sandbox_id}'.", code="unknown_sandbox") from None
        return {"sandbox_id": sandbox_id, "stopped": stopped}

    return action_audited(
        actor=actor, action=AuditEntry.Action.SANDBOX_STOP, task_id=task_id, target=f"sandbox {sandbox_id}", run=run
    )


def step_announce(*, task_ids: list[str], rollouts_per_task: int) -> dict[str, dict[str, int]]:
    """Before a training step: fill each managed task's root pool up to one sandbox per announced
    rollout, and pre-fork its hottest live snapshots (one copy each, as many as rollouts)."""
    planned = {}
    for task in Task.objects.filter(pk__in=task_ids):
        if not is_managed(task.env.get("backend", "external")):
            continue
        waiting = Sandbox.objects.filter(task=task, state__in=WAITING)
        roots = max(0, rollouts_per_task - waiting.filter(pool=Sandbox.Pool.ROOT).count())
        room = max(
            0,
            min(rollouts_per_task, settings.TVCACHE["PREFORKS_PER_TASK"])
            - waiting.filter(pool=Sandbox.Pool.FORK).count(),
        )
        hot = list(
            Snapshot.objects.filter(task=task, status=Snapshot.Status.LIVE, owner=Snapshot.Owner.SERVICE)
            .annotate(waiting=Count("forks", filter=Q(forks__state__in=WAITING)))
            .filter(waiting=0)
            .order_by("-node__hit_count", "-node__depth")
            .values_list("pk", flat=True)[:room]
        )
        pool_request(task_id=task.pk, roots=roots, snapshot_ids=hot)
        planned[task.pk] = {"roots": roots, "forks": len(hot)}
    return planned
