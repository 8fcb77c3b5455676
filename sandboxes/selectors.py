"""Reads about managed sandboxes: the pools overview (dashboard, /api/v1/pools)."""

from __future__ import annotations

import time
from statistics import median, quantiles

from django.db.models import Count

from cache.models import Snapshot
from sandboxes.backends.base import SandboxError
from sandboxes.models import Sandbox

from .services.runtime import backend_named

HEALTH_TTL_S = 10.0
_health: dict[str, tuple[dict, float]] = {}


def engine_health(name: str = "docker") -> dict:
    """The backend's health, cached a few seconds: pages render it on every view."""
    cached = _health.get(name)
    if cached and cached[1] > time.monotonic():
        return cached[0]
    try:
        report = backend_named(name).health()
    except SandboxError as exc:
        report = {"ok": False, "detail": exc.message}
    report = {"backend": name, "ok": bool(report.get("ok")), "detail": report.get("detail") or report.get("error", ""),
              **{k: v for k, v in report.items() if k not in ("ok", "detail")}}
    _health[name] = (report, time.monotonic() + HEALTH_TTL_S)
    return report


def _percentiles(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    if len(values) == 1:
        return values[0], values[0]
    return median(values), quantiles(values, n=20)[-1]


def pools_overview() -> dict:
    live = Sandbox.objects.exclude(state__in=[Sandbox.State.STOPPED, Sandbox.State.FAILED])
    pools: dict[tuple[str, str, str], dict] = {}
    for row in live.values("task_id", "backend", "pool", "state").annotate(n=Count("id")):
        key = (row["task_id"], row["backend"], row["pool"])
        entry = pools.setdefault(key, {"task_id": row["task_id"], "backend": row["backend"], "pool": row["pool"],
                                       "states": {state: 0 for state in ("warming", "ready", "leased", "stopping")}})
        entry["states"][row["state"]] = row["n"]
    snapshots = [
        {"task_id": s["task_id"], "node_id": s["node_id"], "ref": s["ref"], "backend": s["backend"],
         "size_bytes": s["size_bytes"], "status": s["status"]}
        for s in Snapshot.objects.filter(status=Snapshot.Status.LIVE).order_by("-created_at")
        .values("task_id", "node_id", "ref", "backend", "size_bytes", "status")[:500]
    ]
    recent = Sandbox.objects.exclude(start_ms=None).order_by("-created_at")
    warm = [ms for ms in recent.filter(pool=Sandbox.Pool.FORK, rollout=None).values_list("start_ms", flat=True)[:500]]
    cold = [ms for ms in recent.filter(pool=Sandbox.Pool.FORK).exclude(rollout=None).values_list("start_ms", flat=True)[:500]]
    warm_p50, warm_p95 = _percentiles(warm)
    cold_p50, cold_p95 = _percentiles(cold)
    return {
        "engine": engine_health(),
        "pools": sorted(pools.values(), key=lambda p: (p["task_id"], p["pool"])),
        "snapshots": snapshots,
        "fork_latency_ms": {"warm_p50": warm_p50, "warm_p95": warm_p95, "cold_p50": cold_p50, "cold_p95": cold_p95},
    }
