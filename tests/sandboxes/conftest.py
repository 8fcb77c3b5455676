"""Fixtures for managed sandboxes: a real Celery worker on Redis, the real Docker engine."""

from __future__ import annotations

import docker
import pytest
from celery.contrib.testing.worker import start_worker

from sandboxes.images import build_busybox_image
from tvcache_site.celery import app as celery_app


@pytest.fixture(scope="session")
def busybox(django_db_blocker):
    client = docker.from_env()
    client.ping()  # a missing engine fails the run
    build_busybox_image(client)
    return client


@pytest.fixture
def celery_worker(transactional_db, settings):
    """A real worker thread consuming the test session's queue on the real Redis broker."""
    assert not settings.CELERY_TASK_ALWAYS_EAGER, "set REDIS_URL: the tests need a real broker"
    with start_worker(celery_app, pool="threads", concurrency=2, queues=[celery_app.conf.task_default_queue],
                      perform_ping_check=False, shutdown_timeout=30):
        yield


@pytest.fixture
def docker_task(api, busybox):
    def make(task_id: str, **extra) -> str:
        body = {"env": {"backend": "docker"}, "tools": {}, "sandbox_budget": 8, **extra}
        response = api.put(f"/api/v1/tasks/{task_id}", body, format="json")
        assert response.status_code in (200, 201), response.content
        return task_id

    return make
