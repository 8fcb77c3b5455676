"""Fixtures for managed sandboxes: a real Celery worker on Redis, the real Docker engine."""

from __future__ import annotations

import docker
import pytest

from cache.models import BackendCost
from cache.services import snapshots as snapshot_costs
from sandboxes.handles import backend_named, labels
from sandboxes.images import build_busybox_image

from .dockerd import SecondEngine


@pytest.fixture(scope="session")
def busybox(django_db_blocker):
    client = docker.from_env()
    client.ping()  # a missing engine fails the run
    build_busybox_image(client)
    return client


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


@pytest.fixture
def second_engine():
    """A dockerd of the test's own with the busybox image built on it (its own build, so its id
    differs from the machine engine's); stopped, its bridge and folder removed afterwards."""
    engine = SecondEngine()
    try:
        engine.start()
        build_busybox_image(engine.client())
        yield engine
    finally:
        engine.remove()


@pytest.fixture
def snapshot_every_call():
    """Snapshots and restores measured as nearly free: the graph wants a snapshot after every
    state-changing call, as it would after a slow one."""
    BackendCost.objects.update_or_create(
        backend="docker", defaults={"snapshot_ms": 0.5, "restore_ms": 0.5, "snapshot_samples": 1, "restore_samples": 1}
    )
    snapshot_costs._costs.clear()
    yield
    snapshot_costs._costs.clear()
