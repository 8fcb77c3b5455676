"""Reads about managed sandboxes: the pools overview (dashboard, /api/v1/pools), a task's
sandboxes (/api/v1/tasks/{id}/sandboxes)."""

from __future__ import annotations

from statistics import median, quantiles

from django.db.models import Count

from accounts.projects import key_project, task_public_id
from cache.models import Snapshot
from cache.selectors import task_get
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


def live_sandboxes(*, project_id: int) -> int:
    """Sandboxes of the project's tasks that hold (or are about to hold) a container or folder."""
    return Sandbox.objects.filter(task__project_id=project_id).exclude(state__in=LIVE_EXCLUDED).count()


def pools_overview(
    *, project_id: int | None = None, project_ids: list[int] | None = None, public_ids: bool = False
) -> dict:
    """Pools, live snapshots and fork latency of one project's tasks, of several, or (both None)
    of every project; the engine's health. `public_ids`: tasks named as their project knows them
    (the API), else by key (the dashboard), each entry with its project's name."""
    scope = {}
    if project_id is not None:
        scope["task__project_id"] = project_id
    if project_ids is not None:
        scope["task__project_id__in"] = project_ids
    name = task_public_id if public_ids else (lambda key: key)
    live = Sandbox.objects.filter(**scope).exclude(state__in=LIVE_EXCLUDED)
    pools: dict[tuple[str, str, str], dict] = {}
    for row in live.values("task_id", "backend", "pool", "state").annotate(n=Count("id")):
        key = (row["task_id"], row["backend"], row["pool"])
        entry = pools.setdefault(
            key,
            {
                "task_id": name(row["task_id"]),
                "project": key_project(row["task_id"]),
                "backend": row["backend"],
                "pool": row["pool"],
                "states": {state: 0 for state in ("warming", "ready", "leased", "stopping")},
            },
        )
        entry["states"][row["state"]] = row["n"]
    snapshots = [
        {
            "task_id": name(s["task_id"]),
            "project": key_project(s["task_id"]),
            "node_id": s["node_id"],
            "ref": s["ref"],
            "backend": s["backend"],
            "size_bytes": s["size_bytes"],
            "status": s["status"],
        }
        for s in Snapshot.objects.filter(status=Snapshot.Status.LIVE, **scope)
        .order_by("-created_at")
        .values("task_id", "node_id", "ref", "backend", "size_bytes", "status")[:500]
    ]
    recent = Sandbox.objects.filter(**scope).exclude(start_ms=None).order_by("-created_at")
    warm = [ms for ms in recent.filter(pool=Sandbox.Pool.FORK, rollout=None).values_list("start_ms", flat=True)[:500]]
    cold = [
        ms
        for ms in recent.filter(pool=Sandbox.Pool.FORK).exclude(rollout=None).values_list("start_ms", flat=True)[:500]
    ]
    warm_p50, warm_p95 = _percentiles(warm)
    cold_p50, cold_p95 = _percentiles(cold)
    engine, engines_each = engines_health()
    if project_id is not None or project_ids is not None:  # the engines' counts span every project
        engine = {k: v for k, v in engine.items() if k != "running_sandboxes"}
        engines_each = [
            {k: v for k, v in entry.items() if k not in ("running_sandboxes", "live_sandboxes")}
            for entry in engines_each
        ]
    return {
        "engine": engine,
        "engines": engines_each,
        "pools": sorted(pools.values(), key=lambda p: (p["task_id"], p["pool"])),
        "snapshots": snapshots,
        "fork_latency_ms": {"warm_p50": warm_p50, "warm_p95": warm_p95, "cold_p50": cold_p50, "cold_p95": cold_p95},
    }


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
