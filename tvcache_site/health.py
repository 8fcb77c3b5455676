"""GET /healthz (liveness) and GET /readyz (readiness), without a token, for load balancers and
orchestrators (docs/operations/deploy.md).

- /healthz answers 200 as long as the process answers: restart it when it does not.
- /readyz checks what serving needs and what background work needs, each with its time:
  PostgreSQL (required: 503 without it), the broker (required when configured: jobs are queued
  there), the Celery workers' heartbeats and the queue's backlog (background work: `degraded`,
  still 200, when jobs wait with no worker to take them), and the docker engines (tool-server
  mode's sandboxes: `degraded` when one does not answer). Nothing secret is in the answer: no
  addresses, no credentials.
"""

from __future__ import annotations

import time

from django.conf import settings
from django.db import connection
from django.http import HttpResponse, JsonResponse

from core.background import backlog


def healthz(request) -> HttpResponse:
    return JsonResponse({"status": "ok"})


def readyz(request) -> HttpResponse:
    checks = {"database": _timed(_database), "background": _timed(_background)}
    if settings.TVCACHE.get("DOCKER_ENABLED", True):
        checks["engines"] = _timed(_engines)
    required_down = not checks["database"]["ok"] or checks["background"].get("broker_up") is False
    status = "down" if required_down else "ok" if all(c["ok"] for c in checks.values()) else "degraded"
    return JsonResponse({"status": status, "checks": checks}, status=503 if required_down else 200)


def _timed(check) -> dict:
    started = time.perf_counter()
    try:
        found = check()
    except Exception as exc:  # a check that fails is the answer, never an error page
        found = {"ok": False, "detail": type(exc).__name__}
    return {**found, "ms": round((time.perf_counter() - started) * 1000, 1)}


def _database() -> dict:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return {"ok": True}


def _background() -> dict:
    found = backlog()
    if found is None:
        return {"ok": True, "mode": "embedded", "detail": "no broker: background work runs in process"}
    if not found.broker_up:
        return {"ok": False, "mode": "broker", "broker_up": False, "detail": "the broker (Redis) did not answer"}
    detail = f"{found.waiting} jobs wait and no worker takes them" if found.stalled else ""
    if not found.workers and not found.stalled:
        detail = "no worker is running: the next background job will wait"
    return {
        "ok": found.workers > 0,
        "mode": "broker",
        "broker_up": True,
        "queue_depth": found.waiting,
        "workers": found.workers,
        "detail": detail,
    }


def _engines() -> dict:
    from sandboxes.selectors import engines_health

    together, each = engines_health()
    return {"ok": bool(together.get("ok")), "engines": len(each), "down": sum(not e["ok"] for e in each)}
