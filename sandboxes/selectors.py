"""Reads about managed sandboxes: the pools per task a page at a time (/api/v1/pools and the
dashboard's pools page), a task's live snapshots a page at a time, a task's sandboxes
(/api/v1/tasks/{id}/sandboxes)."""

from __future__ import annotations

from statistics import median, quantiles

from django.db.models import Count, OuterRef, Q, Subquery
from django.utils import timezone

from accounts.projects import key_project, task_public_id
from cache.models import Lease, Snapshot, SnapshotTotal, Task
from cache.selectors import snapshot_totals, task_get
from core.ttl import TTLCache
from sandboxes.backends.base import SandboxError
from sandboxes.models import Sandbox

from .engines import Engine, engines, live_per_engine
from .handles import engine_backend

HEALTH_TTL_S = 10.0
_health: TTLCache[str, dict] = TTLCache()


def engine_health(engine: Engine) -> dict:
    """A docker engine's health, cached a few seconds: pages render it on every view."""
    cached = _health.get(engine.name)
    if cached is not None:
        return cached
    try:
        report = engine_backend("docker", engine.name).health()
    except SandboxError as exc:
        report = {"ok": False, "detail": exc.message}
    report = {
        "backend": "docker",
        "ok": bool(report.get("ok")),
        "detail": report.get("detail") or report.get("error", ""),
        **{k: v for k, v in report.items() if k not in ("ok", "detail")},
    }
    _health.put(engine.name, report, HEALTH_TTL_S)
    return report


def engines_health() -> tuple[dict, list[dict]]:
    """The deployment's docker engines: together (the one engine's health as it is, or whether all
    of several answer), and each with its capacity, live sandboxes and Celery queue."""
    live = live_per_engine()
    each = [
        {
            "url": engine.label,
            "capacity": engine.capacity,
            "live_sandboxes": live[engine.name],
            "queue": engine.queue,
            **engine_health(engine),
        }
        for engine in engines()
    ]
    if len(each) == 1:
        return engine_health(engines()[0]), each
    down = [entry["url"] for entry in each if not entry["ok"]]
    together = {
        "backend": "docker",
        "ok": not down,
        "detail": f"down: {', '.join(down)}" if down else "",
        "engines": len(each),
        "running_sandboxes": sum(entry.get("running_sandboxes", 0) for entry in each),
    }
    return together, each


def _percentiles(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    if len(values) == 1:
        return values[0], values[0]
    return median(values), quantiles(values, n=20)[-1]


LIVE_EXCLUDED = (Sandbox.State.STOPPED, Sandbox.State.FAILED)
POOL_STATES = ("warming", "ready", "leased", "stopping")
LATENCY_SAMPLES = 500


def live_sandboxes(*, project_id: int) -> int:
    """Sandboxes of the project's tasks that hold (or are about to hold) a container or folder."""
    return Sandbox.objects.filter(task__project_id=project_id).exclude(state__in=LIVE_EXCLUDED).count()


def _pool_scope(project_id: int | None, project_ids: list[int] | None) -> dict:
    scope = {}
    if project_id is not None:
        scope["task__project_id"] = project_id
    if project_ids is not None:
        scope["task__project_id__in"] = project_ids
    return scope


def fork_latency(
    *, project_id: int | None = None, project_ids: list[int] | None = None, task_id: str | None = None
) -> dict:
    """P50 and P95 of the latest forks' start times, warm (pre-forks) and cold (forked for a
    rollout): of one project's tasks, of several, of one task, or (all None) of every task."""
    scope = _pool_scope(project_id, project_ids)
    if task_id is not None:
        scope["task_id"] = task_id
    recent = Sandbox.objects.filter(**scope).exclude(start_ms=None).order_by("-created_at")
    forks = recent.filter(pool=Sandbox.Pool.FORK)
    warm = list(forks.filter(rollout=None).values_list("start_ms", flat=True)[:LATENCY_SAMPLES])
    cold = list(forks.exclude(rollout=None).values_list("start_ms", flat=True)[:LATENCY_SAMPLES])
    warm_p50, warm_p95 = _percentiles(warm)
    cold_p50, cold_p95 = _percentiles(cold)
    return {"warm_p50": warm_p50, "warm_p95": warm_p95, "cold_p50": cold_p50, "cold_p95": cold_p95}


def engines_seen(*, scoped: bool) -> tuple[dict, list[dict]]:
    """The engines' health; without their counts of sandboxes when the reader sees only some
    projects (the counts span every project)."""
    engine, each = engines_health()
    if not scoped:
        return engine, each
    engine = {k: v for k, v in engine.items() if k != "running_sandboxes"}
    each = [{k: v for k, v in entry.items() if k not in ("running_sandboxes", "live_sandboxes")} for entry in each]
    return engine, each


def live_sandboxes_per_task(*, task_keys: list[str]) -> dict[str, int]:
    """Sandboxes not on their way out (warming, ready, leased), per task of the given ones."""
    rows = (
        Sandbox.objects.filter(task_id__in=task_keys)
        .exclude(state__in=(*LIVE_EXCLUDED, Sandbox.State.STOPPING))
        .values("task_id")
        .annotate(n=Count("id"))
    )
    return {row["task_id"]: row["n"] for row in rows}


def pools_listed(*, project_id: int, limit: int, offset: int) -> dict:
    """GET /api/v1/pools: the engines' health, the fork latency and totals of the project's tasks,
    and one page of those tasks that hold live snapshots or sandboxes, in id order, each summarized
    in one row (pool_tasks; named as the project knows them), with `count` (every page's) and
    `next_offset` (None on the last page). `pools`: the page's pools by task, backend and pool, each
    with its count per state. Statements bounded by the page, not by the snapshots."""
    keys = pool_task_keys(project_ids=[project_id])
    count = keys.count()
    tasks = pool_tasks(task_keys=[key for (key,) in keys[offset : offset + limit]])
    pools = []
    for row in tasks:
        row["task_id"] = task_public_id(row["task_id"])
        pools.extend({"task_id": row["task_id"], "project": row["project"], **pool} for pool in row["pools"])
    engine, engines_each = engines_seen(scoped=True)
    return {
        "engine": engine,
        "engines": engines_each,
        "fork_latency_ms": fork_latency(project_id=project_id),
        "totals": {**pool_totals(project_ids=[project_id]), "tasks": count},
        "tasks": tasks,
        "pools": pools,
        "count": count,
        "next_offset": offset + limit if offset + limit < count else None,
    }


# --- per task (the dashboard's pools page) ----------------------------------------------------
# A training run has a task per prompt and each task up to its budget of snapshots, so the page
# shows one row per task, a page of tasks at a time, and a task's snapshots a page at a time.


def pool_task_keys(*, project_ids: list[int] | None = None):
    """Keys of the tasks that hold a live snapshot or a live sandbox, in key order (a queryset of
    1-tuples, for a paginator). One index probe per task (`snapshot_live_task`), not a read of
    every live snapshot: a task may hold its whole budget of them. Scalar subqueries, not EXISTS,
    which PostgreSQL may plan as a hash of every live snapshot."""
    tasks = Task.objects.all() if project_ids is None else Task.objects.filter(project_id__in=project_ids)
    snapshot = Snapshot.objects.filter(task_id=OuterRef("pk"), status=Snapshot.Status.LIVE).values("pk")[:1]
    sandbox = Sandbox.objects.filter(task_id=OuterRef("pk")).exclude(state__in=LIVE_EXCLUDED).values("pk")[:1]
    return (
        tasks.annotate(snapshot=Subquery(snapshot), sandbox=Subquery(sandbox))
        .filter(Q(snapshot__isnull=False) | Q(sandbox__isnull=False))
        .order_by("pk")
        .values_list("pk")
    )


def pool_totals(*, project_ids: list[int] | None = None) -> dict:
    """Live snapshots, their bytes and live sandboxes of the projects' tasks (None: every one)."""
    scope = _pool_scope(None, project_ids)
    snapshots = snapshot_totals(SnapshotTotal.objects.filter(**scope))
    return {
        "snapshots": snapshots["live"],
        "bytes": snapshots["live_bytes"],
        "sandboxes": Sandbox.objects.filter(**scope).exclude(state__in=LIVE_EXCLUDED).count(),
    }


def pool_tasks(*, task_keys: list[str]) -> list[dict]:
    """Per task, in the given order: its live snapshots (count, bytes, newest, leased), backends,
    budget, live sandboxes by state, pre-forks ready, and its pools (by backend and pool, each by
    state). Four statements whatever the counts."""
    rows = {
        key: {
            "task_id": key,
            "project": key_project(key),
            "budget": None,
            "snapshots": 0,
            "bytes": 0,
            "newest": None,
            "leased": 0,
            "backends": set(),
            "states": dict.fromkeys(POOL_STATES, 0),
            "preforks": 0,
            "pools": {},
        }
        for key in task_keys
    }
    live = Snapshot.objects.filter(task_id__in=task_keys, status=Snapshot.Status.LIVE)
    # The newest live snapshot: one step of a backward read of snapshot_live_task per task.
    newest = live.filter(task_id=OuterRef("pk")).order_by("-created_at").values("created_at")[:1]
    tasks = Task.objects.filter(pk__in=task_keys).annotate(newest=Subquery(newest))
    for key, budget, created in tasks.values_list("pk", "sandbox_budget", "newest"):
        rows[key]["budget"], rows[key]["newest"] = budget, created
    for total in SnapshotTotal.objects.filter(task_id__in=task_keys, live__gt=0):
        row = rows[total.task_id]
        row["snapshots"] += total.live
        row["bytes"] += total.live_bytes
        row["backends"].add(total.backend)
    leased = (
        Lease.objects.filter(snapshot__in=live, released_at__isnull=True, expires_at__gt=timezone.now())
        .values("snapshot__task_id")
        .annotate(n=Count("snapshot_id", distinct=True))
    )
    for lease in leased:
        rows[lease["snapshot__task_id"]]["leased"] = lease["n"]
    sandboxes = Sandbox.objects.filter(task_id__in=task_keys).exclude(state__in=LIVE_EXCLUDED)
    for s in sandboxes.values("task_id", "backend", "pool", "state").annotate(n=Count("id")):
        row = rows[s["task_id"]]
        row["states"][s["state"]] += s["n"]
        row["backends"].add(s["backend"])
        pool = row["pools"].setdefault(
            (s["backend"], s["pool"]),
            {"backend": s["backend"], "pool": s["pool"], "states": dict.fromkeys(POOL_STATES, 0)},
        )
        pool["states"][s["state"]] = s["n"]
        if s["pool"] == Sandbox.Pool.FORK and s["state"] == Sandbox.State.READY:
            row["preforks"] += s["n"]
    for row in rows.values():
        row["backends"] = sorted(row["backends"])
        row["pools"] = [row["pools"][key] for key in sorted(row["pools"])]
    return list(rows.values())


def task_live_snapshots(*, task_id: str):
    """The task's live snapshots, newest first (a queryset of dicts, for a paginator: only the
    page is read; `snapshot_usage` then counts the page's leases and pre-forks)."""
    return (
        Snapshot.objects.filter(task_id=task_id, status=Snapshot.Status.LIVE)
        .order_by("-created_at", "-pk")
        .values("pk", "node_id", "ref", "backend", "engine", "size_bytes", "keeps_processes", "created_at")
    )


def snapshot_usage(*, snapshot_ids: list[int]) -> dict[int, dict]:
    """Open leases and ready pre-forks of each given snapshot (one statement)."""
    now = timezone.now()
    rows = (
        Snapshot.objects.filter(pk__in=snapshot_ids)
        .annotate(
            open_leases=Count(
                "leases", filter=Q(leases__released_at__isnull=True, leases__expires_at__gt=now), distinct=True
            ),
            preforks=Count(
                "forks", filter=Q(forks__pool=Sandbox.Pool.FORK, forks__state=Sandbox.State.READY), distinct=True
            ),
        )
        .values_list("pk", "open_leases", "preforks")
    )
    return {pk: {"open_leases": leases, "preforks": forks} for pk, leases, forks in rows}


def task_sandboxes(*, task_id: str) -> dict:
    """How many sandboxes the service started or forked for the task (every one that got
    running), and those alive now with the rollout each serves (/api/v1/tasks/{id}/sandboxes)."""
    task_get(task_id=task_id)
    rows = Sandbox.objects.filter(task_id=task_id)
    live = (
        rows.exclude(state__in=LIVE_EXCLUDED)
        .order_by("pk")
        .values("pk", "backend", "pool", "state", "rollout__rollout_id", "ref")
    )
    return {
        "started": rows.filter(ready_at__isnull=False).count(),
        "live": [
            {
                "id": row["pk"],
                "backend": row["backend"],
                "pool": row["pool"],
                "state": row["state"],
                "rollout_id": row["rollout__rollout_id"],
                "ref": row["ref"],
            }
            for row in live
        ],
    }
