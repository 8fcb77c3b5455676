"""Calls for the tool-server tests, and Celery workers of their own."""

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from celery.contrib.testing.worker import start_worker

from sandboxes.services.reserved import settle
from tvcache_site.celery import app as celery_app


def bash(command: str, **args) -> dict:
    return {"tool": "bash", "args": {"command": command, **args}}


def run(api, task_id: str, rollout_id: str, call: dict, status: int = 200, *, settled: bool = True) -> dict:
    """A tool-server call. `settled`: returns once the snapshot its miss may have handed off is
    taken (it is taken after the answer, sandboxes/services/reserved.py), so that what the test
    looks at next is the graph the call left."""
    response = api.post(f"/api/v1/tasks/{task_id}/rollouts/{rollout_id}/calls", {"call": call}, format="json")
    assert response.status_code == status, response.content
    if settled:
        assert settle(), "background snapshots still running"
    return response.json()


def wait_for(predicate, timeout=60.0):
    """Until a worker's background work shows."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError("condition not reached in time")


@contextmanager
def worker_on(queues: list[str]) -> Iterator[None]:
    """A real worker thread consuming `queues` on the real Redis broker."""
    kept = _logging_state()
    try:
        with start_worker(celery_app, pool="threads", concurrency=2, queues=queues, perform_ping_check=False,
                          shutdown_timeout=30):
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
