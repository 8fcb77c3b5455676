"""Fixtures for managed sandboxes: a real Celery worker on Redis, the real Docker engine."""

from __future__ import annotations

import logging

import docker
import pytest
from celery.contrib.testing.worker import start_worker

from sandboxes.images import build_busybox_image
from sandboxes.services.runtime import backend_named, labels
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
    kept = _logging_state()
    try:
        with start_worker(celery_app, pool="threads", concurrency=2, queues=[celery_app.conf.task_default_queue],
                          perform_ping_check=False, shutdown_timeout=30):
            yield
    finally:  # the worker sets up logging for its process; later tests' caplog needs it back
        _logging_restore(kept)


def _logging_state() -> dict:
    loggers = [logging.root, *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger))]
    return {logger: (logger.disabled, logger.propagate, logger.level, list(logger.handlers)) for logger in loggers}


def _logging_restore(kept: dict) -> None:
    for logger, (disabled, propagate, level, handlers) in kept.items():
        logger.disabled, logger.propagate, logger.level, logger.handlers = disabled, propagate, level, handlers
    for logger in logging.root.manager.loggerDict.values():
        if isinstance(logger, logging.Logger) and logger not in kept:
            logger.disabled = False


@pytest.fixture
def docker_task(api, busybox):
    """Docker tasks of one test; whatever the test leaves on the engine for them (a rollout it did
    not end, a snapshot) is removed afterwards: the test database that knew them is gone."""
    made = []

    def make(task_id: str, **extra) -> str:
        body = {"env": {"backend": "docker"}, "tools": {}, "sandbox_budget": 8, **extra}
        response = api.put(f"/api/v1/tasks/{task_id}", body, format="json")
        assert response.status_code in (200, 201), response.content
        made.append(task_id)
        return task_id

    yield make
    backend = backend_named("docker")
    for task_id in made:
        selector = labels(task_id)
        for sandbox in backend.list_sandboxes(selector):
            backend.remove_sandbox(sandbox.id)
        for snapshot in backend.list_snapshots(selector):
            backend.delete_snapshot(snapshot.id)
