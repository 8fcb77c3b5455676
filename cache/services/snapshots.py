"""Snapshots, leases and the budget that evicts snapshots (results stay cached)."""

from __future__ import annotations

import uuid

from django.db import transaction
from django.db.models import Count, Sum
from django.utils import timezone

from accounts.models import Project
from accounts.projects import key_project
from cache import ledger
from cache.models import BackendCost, Lease, Node, Snapshot, Task
from cache.notfound import unknown_node
from cache.tcg.eviction import SnapshotCandidate, eviction_order, reuse_score
from cache.tcg.snapshots import SnapshotCosts, moving_average
from core.errors import Conflict, Forbidden, InvalidInput, NotFound
from core.ttl import TTLCache

# Before a backend has been measured: what a snapshot and a restore typically cost, in ms.
DEFAULT_COSTS = {
    "docker": SnapshotCosts(snapshot_ms=400.0, restore_ms=300.0),
    "directory": SnapshotCosts(snapshot_ms=20.0, restore_ms=20.0),
    "sqlite": SnapshotCosts(snapshot_ms=10.0, restore_ms=10.0),
    "external": SnapshotCosts(snapshot_ms=50.0, restore_ms=50.0),
}
EVICTION_NOTICE_S = 60.0  # how long an evicted client snapshot's ref is reported in responses
COSTS_CACHE_TTL_S = 5.0
_costs: TTLCache[str, SnapshotCosts] = TTLCache()
# The least an evictable live snapshot of a task is worth to the eviction (snapshot_would_stay).
EVICTION_FLOOR_TTL_S = 5.0
_floors: TTLCache[str, float] = TTLCache()


def backend_costs(backend: str) -> SnapshotCosts:
    costs = _costs.get(backend)
    if costs is None:
        row = BackendCost.objects.filter(pk=backend).values_list("snapshot_ms", "restore_ms").first()
        costs = SnapshotCosts(*row) if row else DEFAULT_COSTS.get(backend, DEFAULT_COSTS["external"])
        _costs.put(backend, costs, COSTS_CACHE_TTL_S)
    return costs


def _cost_sample(backend: str, *, snapshot_ms: float | None = None, restore_ms: float | None = None) -> None:
    with transaction.atomic():
        default = DEFAULT_COSTS.get(backend, DEFAULT_COSTS["external"])
        row, _ = BackendCost.objects.select_for_update().get_or_create(
            pk=backend, defaults={"snapshot_ms": default.snapshot_ms, "restore_ms": default.restore_ms}
        )
        if snapshot_ms is not None:
            row.snapshot_ms = moving_average(row.snapshot_ms if row.snapshot_samples else None, snapshot_ms)
            row.snapshot_samples += 1
        if restore_ms is not None:
            row.restore_ms = moving_average(row.restore_ms if row.restore_samples else None, restore_ms)
            row.restore_samples += 1
        row.save()


def snapshot_register(
    *,
    task_id: str,
    node_id: int,
    ref: str,
    backend: str,
    engine: str = "",
    size_bytes: int | None = None,
    create_ms: float | None = None,
    owner: str = Snapshot.Owner.CLIENT,
    keeps_processes: bool = False,
    exact: bool = True,
) -> tuple[Snapshot, list[str]]:
    """`keeps_processes`: the snapshot holds the sandbox's processes (a checkpoint), so that it may
    be forked for the node's state when that has live processes. `exact`: it copies the state the
    node's call left, not a replay of it (Snapshot.exact)."""
    with transaction.atomic():
        node = Node.objects.select_for_update().defer("file_times").filter(pk=node_id, task_id=task_id).first()
        if node is None:
            raise unknown_node(task_id, node_id)
        if not node.mutates:
            raise InvalidInput(
                "A read-only call leaves its parent's state: snapshot the parent instead.", code="snapshot_on_read_only"
            )
        existing = node.snapshots.filter(status=Snapshot.Status.LIVE).first()
        if existing is not None:
            raise Conflict(
                "The node already has a live snapshot.",
                code="snapshot_exists",
                details={"snapshot_id": existing.pk, "ref": existing.ref},
            )
        if Snapshot.objects.filter(task_id=task_id, ref=ref).exists():
            raise Conflict(f"Snapshot ref '{ref}' is already registered.", code="duplicate_ref")
        _snapshot_bytes_granted(task_id, size_bytes)
        snapshot = Snapshot.objects.create(
            task_id=task_id,
            node=node,
            backend=backend,
            engine=engine,
            ref=ref,
            owner=owner,
            size_bytes=size_bytes,
            create_ms=create_ms,
            keeps_processes=keeps_processes,
            exact=exact,
        )
        ledger.snapshot_event(task_id, "created", node_id=node_id, ref=ref, snapshot_id=snapshot.pk)
    if create_ms is not None:
        _cost_sample(backend, snapshot_ms=create_ms)
    evicted = task_enforce_budget(task_id=task_id)
    _floors.pop(task_id)  # the live snapshots changed: the next would-stay reads them again
    return snapshot, [s.ref for s in evicted]


def _snapshot_bytes_granted(task_id: str, size_bytes: int | None) -> None:
    """Refuse a snapshot that would take its project past its grant of live snapshot bytes
    (403 snapshot_quota_exceeded); projects without the grant are not bounded. The project's row
    is locked: two snapshots registered at once are counted one after the other."""
    project = (
        Project.objects.select_for_update(of=("self",))
        .filter(tasks__pk=task_id)
        .values_list("pk", "name", "max_snapshot_bytes")
        .first()
    )
    if project is None or project[2] is None:
        return
    pk, name, most = project
    live = (
        Snapshot.objects.filter(task__project_id=pk, status=Snapshot.Status.LIVE).aggregate(n=Sum("size_bytes"))["n"]
        or 0
    )
    if live + (size_bytes or 0) > most:
        raise Forbidden(
            f"Project '{name}' may keep {most} bytes of live snapshots; it keeps {live}, and this one is "
            f"{size_bytes or 0}.",
            code="snapshot_quota_exceeded",
            details={"project": name, "max_snapshot_bytes": most, "live_bytes": live, "size_bytes": size_bytes},
        )


def lease_release(*, lease_id: str, restore_ms: float | None = None, project: str | None = None) -> None:
    """Release a lease; with `project` (an API caller's), a lease on another project's snapshot
    is unknown (404)."""
    try:
        uuid.UUID(str(lease_id))
    except ValueError:
        raise NotFound(f"Unknown lease '{lease_id}'.", code="unknown_lease") from None
    lease = Lease.objects.select_related("snapshot").filter(pk=lease_id).first()
    if lease is None or (project is not None and key_project(lease.snapshot.task_id) != project):
        raise NotFound(f"Unknown lease '{lease_id}'.", code="unknown_lease")
    if lease.released_at is None:
        Lease.objects.filter(pk=lease_id, released_at__isnull=True).update(released_at=timezone.now())
        if restore_ms is not None:
            _cost_sample(lease.snapshot.backend, restore_ms=restore_ms)


def snapshot_evict(*, snapshot: Snapshot) -> bool:
    """Evict one snapshot unless a lease holds it. The caller holds the snapshot's row lock."""
    if snapshot.status != Snapshot.Status.LIVE:
        return False
    if snapshot.leases.filter(released_at__isnull=True, expires_at__gt=timezone.now()).exists():
        return False
    snapshot.status = Snapshot.Status.EVICTED
    snapshot.evicted_at = timezone.now()
    snapshot.save(update_fields=["status", "evicted_at"])
    _announce_evicted([snapshot])
    return True


def task_enforce_budget(*, task_id: str) -> list[Snapshot]:
    """Evict the live snapshots of lowest expected reuse until the task is within its budget."""
    with transaction.atomic():
        budget = Task.objects.filter(pk=task_id).values_list("sandbox_budget", flat=True).first()
        if budget is None:
            return []
        live = list(
            Snapshot.objects.select_for_update(of=("self",))
            .filter(task_id=task_id, status=Snapshot.Status.LIVE)
            .select_related("node")
            .order_by("pk")
        )
        over = len(live) - budget
        if over <= 0:
            return []
        now = timezone.now()
        chosen = set(eviction_order(_candidates(live, now), over))
        evicted = [s for s in live if s.pk in chosen]
        Snapshot.objects.filter(pk__in=chosen).update(status=Snapshot.Status.EVICTED, evicted_at=now)
        _announce_evicted(evicted)
    return evicted


def snapshot_would_stay(*, task_id: str, depth: int, cum_exec_ms: float) -> bool:
    """Whether a snapshot of a node just recorded (no hits nor children yet) would outlast its own
    registration in a task at its budget, which evicts the live snapshot of least expected reuse
    as it takes one more (the older first on a tie). Where the new one would go (the newest state
    of a long path is worth the least to that scoring), taking it, a commit of the sandbox, buys
    nothing. The least any evictable live snapshot of the task is worth is read again when this
    process registers one, else at most once in EVICTION_FLOOR_TTL_S: a view that old costs at worst
    a snapshot taken for nothing or one not taken, never an answer."""
    new = SnapshotCandidate(snapshot_id=0, hit_count=0, children=0, depth=depth, rebuild_ms=cum_exec_ms, idle_s=0.0)
    floor = _floors.get(task_id)
    if floor is None:
        now = timezone.now()
        live = list(Snapshot.objects.filter(task_id=task_id, status=Snapshot.Status.LIVE).select_related("node"))
        floor = min(
            (reuse_score(c) for c in _candidates(live, now) if not (c.leased or c.pinned)), default=float("inf")
        )
        _floors.put(task_id, floor, EVICTION_FLOOR_TTL_S)
    return reuse_score(new) >= floor


def _candidates(live: list[Snapshot], now) -> list[SnapshotCandidate]:
    """The snapshots as the eviction scores them: with their nodes' children and open leases."""
    leased = set(
        Lease.objects.filter(
            snapshot_id__in=[s.pk for s in live], released_at__isnull=True, expires_at__gt=now
        ).values_list("snapshot_id", flat=True)
    )
    children = dict(
        Node.objects.filter(parent_id__in=[s.node_id for s in live])
        .values("parent_id")
        .annotate(n=Count("id"))
        .values_list("parent_id", "n")
    )
    return [_candidate(s, now, children.get(s.node_id, 0), s.pk in leased) for s in live]


def _announce_evicted(snapshots: list[Snapshot]) -> None:
    for snapshot in snapshots:
        ledger.snapshot_event(
            snapshot.task_id, "evicted", node_id=snapshot.node_id, ref=snapshot.ref, snapshot_id=snapshot.pk
        )


def _candidate(snapshot: Snapshot, now, children: int, leased: bool) -> SnapshotCandidate:
    node = snapshot.node
    last_used = node.last_hit_at or node.created_at
    return SnapshotCandidate(
        snapshot_id=snapshot.pk,
        hit_count=node.hit_count,
        children=children,
        depth=node.depth,
        rebuild_ms=node.cum_exec_ms,
        idle_s=max(0.0, (now - last_used).total_seconds()),
        leased=leased,
        pinned=node.pinned,
    )
