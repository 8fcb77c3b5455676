"""Celery tasks: thin wrappers that take ids, call one service and own the retry policy.

All are idempotent and acknowledged late, so a task whose worker died runs again elsewhere.
"""

from __future__ import annotations

from celery import shared_task
from celery.signals import worker_ready
from django.conf import settings

from accounts.services import projects as project_services
from cache import services as cache_services
from core.background import heartbeat_start
from sandboxes import services

RETRY = {"autoretry_for": (ConnectionError,), "retry_backoff": True, "max_retries": 5}


@shared_task(acks_late=True, **RETRY)
def sandbox_warm(sandbox_id: int) -> None:
    services.sandbox_warm(sandbox_id=sandbox_id)


@shared_task(acks_late=True, **RETRY)
def sandbox_stop(sandbox_id: int) -> None:
    services.sandbox_stop(sandbox_id=sandbox_id)


@shared_task(acks_late=True)
def sandboxes_reap() -> dict:
    return services.sandboxes_reap()


@shared_task(acks_late=True)
def snapshots_collect(engine: str | None = None) -> dict:
    return services.snapshots_collect(engine=engine)


@shared_task(acks_late=True)
def orphans_reap() -> dict:
    return services.orphans_reap(grace_s=settings.TVCACHE["ORPHAN_GRACE_S"])


@shared_task(acks_late=True)
def tables_vacuum() -> list[str]:
    return cache_services.tables_vacuum()


@shared_task(acks_late=True)
def indexes_rebuild() -> list[str]:
    return cache_services.indexes_rebuild()


@shared_task(acks_late=True)
def claims_clear() -> int:
    return cache_services.claims_clear()


@shared_task(acks_late=True)
def project_requests_prune() -> int:
    return project_services.project_requests_prune()


@shared_task(acks_late=True, **RETRY)
def hit_audit(task_id: str, node_id: int, rollout_pk: int, applied: int, engine: str = "") -> str:
    """Determinism audit of a sampled tool-server hit (sandboxes.services.audit)."""
    return services.hit_audit(task_id=task_id, node_id=node_id, rollout_pk=rollout_pk, applied=applied, engine=engine)


@worker_ready.connect
def _heartbeat(sender, **_) -> None:
    """A worker says it is alive, for each queue it consumes (core.background.backlog reads it)."""
    queues = [queue.name for queue in getattr(sender.task_consumer, "queues", ())] or [
        sender.app.conf.task_default_queue
    ]
    heartbeat_start(sender.hostname, queues)
