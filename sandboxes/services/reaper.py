"""Reaping: expired leases, idle rollouts' sandboxes, warm-ups of dead workers, evicted
snapshots' storage, and orphans (sandboxes and snapshots labelled as ours that the database
does not know). Every function is idempotent; workers run them periodically."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from cache.models import Lease, Snapshot
from cache.services import rollouts_expire, snapshot_evict, task_enforce_budget, tasks_enforce_retention
from sandboxes.backends import BACKEND_NAMES
from sandboxes.backends.base import SandboxError
from sandboxes.engines import engines
from sandboxes.handles import engine_backend, instance_selector, sandbox_backend
from sandboxes.models import Sandbox

from .pools import sandbox_stop, set_state

log = logging.getLogger("tvcache.reaper")
ORPHAN_GRACE_S = 120.0  # a sandbox this young may still be on its way into the database


def sandboxes_reap() -> dict[str, int]:
    now = timezone.now()
    leases = Lease.objects.filter(released_at__isnull=True, expires_at__lte=now).update(released_at=now)
    idle = list(
        Sandbox.objects.filter(state=Sandbox.State.LEASED, lease_expires_at__lte=now).values_list("pk", flat=True)
    )
    ended = list(
        Sandbox.objects.filter(state=Sandbox.State.LEASED, rollout__finished_at__isnull=False).values_list(
            "pk", flat=True
        )
    )
    unused = now - timedelta(seconds=settings.TVCACHE["POOL_IDLE_S"])
    idle += list(Sandbox.objects.filter(state=Sandbox.State.READY, ready_at__lte=unused).values_list("pk", flat=True))
    for sandbox_id in {*idle, *ended}:
        sandbox_stop(sandbox_id=sandbox_id)
    stale = now - timedelta(seconds=settings.TVCACHE["WARMING_TIMEOUT_S"])
    dead = list(Sandbox.objects.filter(state=Sandbox.State.WARMING, created_at__lte=stale))
    for row in dead:
        set_state(row, Sandbox.State.FAILED, error="warm-up never finished (worker died?)")
    return {"leases": leases, "sandboxes": len({*idle, *ended}), "warmups": len(dead)}


def snapshots_collect(*, engine: str | None = None) -> dict[str, int]:
    """Enforce every task's budget, then free the storage of evicted service snapshots (those on
    `engine` only, if given) and stop the pre-forks nobody will take any more. The periodic run (no
    `engine`) then enforces the tasks' retention of results, which spares a node while its
    snapshot's storage is held: freed first, its node may go in the same round; and expires the
    rollouts whose history nothing needs any more."""
    for task_id in Snapshot.objects.filter(status=Snapshot.Status.LIVE).values_list("task_id", flat=True).distinct():
        task_enforce_budget(task_id=task_id)
    freed = 0
    evicted = Snapshot.objects.filter(status=Snapshot.Status.EVICTED, owner=Snapshot.Owner.SERVICE)
    for snapshot in evicted.filter(engine=engine) if engine is not None else evicted:
        for sandbox_id in snapshot.forks.filter(state=Sandbox.State.READY).values_list("pk", flat=True):
            sandbox_stop(sandbox_id=sandbox_id)
        try:
            sandbox_backend(snapshot).delete_snapshot(snapshot.ref)
        except SandboxError as exc:
            log.warning("could not delete snapshot %s: %s", snapshot.ref, exc)
            continue
        Snapshot.objects.filter(pk=snapshot.pk).update(status=Snapshot.Status.DELETED)
        freed += 1
    if engine is not None:  # after a miss, for its engine: retention waits for the periodic run
        return {"snapshots_freed": freed}
    return {"snapshots_freed": freed, **tasks_enforce_retention(), **rollouts_expire()}


def tasks_release(*, task_ids: list[str]) -> dict[str, int]:
    """Stop the tasks' sandboxes and free their service snapshots' storage; their results stay
    cached. For a server that stops with its tasks: nothing would reap what its pools keep ready."""
    stopped = sum(
        sandbox_stop(sandbox_id=pk)
        for pk in Sandbox.objects.filter(task_id__in=task_ids)
        .exclude(state__in=[Sandbox.State.STOPPED, Sandbox.State.FAILED])
        .values_list("pk", flat=True)
    )
    with transaction.atomic():
        for snapshot in Snapshot.objects.select_for_update().filter(
            task_id__in=task_ids, owner=Snapshot.Owner.SERVICE, status=Snapshot.Status.LIVE
        ):
            snapshot_evict(snapshot=snapshot)
    return {"sandboxes": stopped, **snapshots_collect()}


def sandboxes_release() -> dict[str, int]:
    """Stop every sandbox of this installation, whatever its pool or rollout, and remove the
    containers labelled as its own that no row accounts for: for a service that stops (the run
    command on SIGTERM or Ctrl-C), since nothing would reap them until it starts again. Results
    and snapshots stay; a rollout that calls again later gets a fresh sandbox and replays."""
    live = Sandbox.objects.exclude(state__in=[Sandbox.State.STOPPED, Sandbox.State.FAILED]).values_list("pk", flat=True)
    stopped = sum(sandbox_stop(sandbox_id=pk) for pk in list(live))
    orphans = orphans_reap(grace_s=0)
    return {"sandboxes": stopped, "orphans": orphans["sandboxes"]}


def orphans_reap(*, grace_s: float = ORPHAN_GRACE_S) -> dict[str, int]:
    """Remove sandboxes and snapshots labelled as ours that no live row accounts for (a worker
    killed between creating a container and saving its id, a deleted task, ...)."""
    cutoff = timezone.now() - timedelta(seconds=grace_s)
    removed = {"sandboxes": 0, "snapshots": 0}
    places = [
        (name, engine)
        for name in BACKEND_NAMES
        for engine in ([e.name for e in engines()] if name == "docker" else [""])
    ]
    for name, engine in places:
        try:
            backend = engine_backend(name, engine)
            known = set(
                Sandbox.objects.filter(backend=name)
                .exclude(state__in=[Sandbox.State.STOPPED, Sandbox.State.FAILED])
                .exclude(ref="")
                .values_list("ref", flat=True)
            )
            for resource in backend.list_sandboxes(instance_selector()):
                if resource.id not in known and _old(resource, cutoff):
                    backend.remove_sandbox(resource.id)
                    removed["sandboxes"] += 1
            kept = set(
                Snapshot.objects.filter(backend=name)
                .filter(Q(status=Snapshot.Status.LIVE) | Q(status=Snapshot.Status.EVICTED))
                .values_list("ref", flat=True)
            )
            for resource in backend.list_snapshots(instance_selector()):
                if resource.id not in kept and _old(resource, cutoff):
                    backend.delete_snapshot(resource.id)
                    removed["snapshots"] += 1
        except SandboxError as exc:  # one backend or engine down must not stop the others' reaping
            log.warning("reaping %s %s failed: %s", name, engine or "", exc)
    return removed


def _old(resource, cutoff) -> bool:
    return resource.created_at is None or resource.created_at <= cutoff
