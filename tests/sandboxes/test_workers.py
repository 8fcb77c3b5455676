"""Background work with a real Celery worker on Redis and the real Docker engine: warm pools,
pre-forks, eviction, reaping."""

from __future__ import annotations

import time
from datetime import timedelta

import docker
import pytest
from django.utils import timezone

from cache.models import Lease, Snapshot, Task
from sandboxes import services
from sandboxes.backends.base import SandboxGone
from sandboxes.handles import backend_named, labels
from sandboxes.models import Sandbox
from tests.support.toolserver import bash, run, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def test_announced_step_warms_roots_and_the_first_miss_takes_one(api, docker_task, celery_worker):
    task = docker_task("step")
    response = api.post("/api/v1/steps", {"tasks": [task], "rollouts_per_task": 2, "epoch": 0}, format="json")
    assert response.status_code == 202 and response.json()["planned"][task] == {"roots": 2, "forks": 0}
    wait_for(lambda: Sandbox.objects.filter(task_id=task, state="ready").count() == 2)
    run(api, task, "r1", bash("echo hi"))
    taken = Sandbox.objects.get(rollout__rollout_id="r1")
    assert taken.pool == "root" and taken.ready_at < timezone.now()
    assert Sandbox.objects.filter(task_id=task, state="ready").count() == 1
    pools = api.get("/api/v1/pools").json()
    assert {
        "task_id": task,
        "project": "default",
        "backend": "docker",
        "pool": "root",
        "states": {"warming": 0, "ready": 1, "leased": 1, "stopping": 0},
    } in pools["pools"]
    assert pools["engine"]["ok"] is True


def test_a_snapshot_becomes_a_ready_fork_in_a_worker_and_a_rollout_takes_it(api, docker_task, celery_worker):
    task = docker_task("prefork")
    setup = bash("sleep 1; echo built > /artifact")
    run(api, task, "r1", setup)
    snapshot = Snapshot.objects.get(task_id=task, status="live")
    wait_for(lambda: Sandbox.objects.filter(snapshot=snapshot, state="ready").exists())
    ready = Sandbox.objects.get(snapshot=snapshot, state="ready")
    run(api, task, "r2", setup)
    assert run(api, task, "r2", bash("cat /artifact"))["result"]["stdout"] == "built\n"
    assert Sandbox.objects.get(rollout__rollout_id="r2").pk == ready.pk  # handed over, not forked anew


def test_eviction_spares_a_leased_snapshot_and_never_breaks_a_running_fork(api, docker_task, busybox):
    task = docker_task("evict")
    setup = bash("sleep 1; echo kept > /f")
    run(api, task, "r1", setup)
    snapshot = Snapshot.objects.get(task_id=task, status="live")
    lease = Lease.objects.create(snapshot=snapshot, expires_at=timezone.now() + timedelta(minutes=5))
    Task.objects.filter(pk=task).update(sandbox_budget=0)
    services.snapshots_collect()
    snapshot.refresh_from_db()
    assert snapshot.status == "live"  # leased: spared
    run(api, task, "r2", setup)
    run(api, task, "r2", bash("true"))  # r2 now runs in a fork of the snapshot
    Lease.objects.filter(pk=lease.pk).update(released_at=timezone.now())
    services.snapshots_collect()
    snapshot.refresh_from_db()
    assert snapshot.status == "deleted"
    with pytest.raises(docker.errors.ImageNotFound):
        busybox.images.get(snapshot.ref)
    assert run(api, task, "r2", bash("cat /f"))["result"]["stdout"] == "kept\n"  # the fork runs on


def test_an_idle_rollout_loses_its_sandbox_and_expired_leases_are_released(api, docker_task, busybox):
    task = docker_task("idle")
    run(api, task, "r", bash("true"))
    row = Sandbox.objects.get(rollout__rollout_id="r")
    Sandbox.objects.filter(pk=row.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    run(api, task, "other", bash("sleep 1; touch /built"))
    snapshot = Snapshot.objects.get(task_id=task)
    Lease.objects.create(snapshot=snapshot, expires_at=timezone.now() - timedelta(seconds=1))
    reaped = services.sandboxes_reap()
    assert reaped["sandboxes"] >= 1 and reaped["leases"] == 1
    row.refresh_from_db()
    assert row.state == "stopped"
    with pytest.raises(docker.errors.NotFound):
        busybox.api.inspect_container(row.ref)


def test_a_killed_workers_sandboxes_are_reaped(api, docker_task, busybox, settings):
    task = docker_task("killed")
    backend = backend_named("docker")
    # A worker died after the engine made the container, before the database knew its id.
    row = Sandbox.objects.create(task_id=task, backend="docker", pool="root")
    orphan = backend.start(Task.objects.get(pk=task).env, labels=labels(task, row.pk))
    Sandbox.objects.filter(pk=row.pk).update(created_at=timezone.now() - timedelta(hours=1))
    settings.TVCACHE = {**settings.TVCACHE, "WARMING_TIMEOUT_S": 60}
    assert services.sandboxes_reap()["warmups"] == 1
    assert services.orphans_reap(grace_s=0)["sandboxes"] >= 1
    with pytest.raises(SandboxGone):
        backend.attach(orphan.sandbox_id)
    assert Sandbox.objects.get(pk=row.pk).state == "failed"


def test_an_unreachable_engine_fails_its_tasks_clearly_and_the_rest_keeps_serving(api, toy_task, settings):
    from sandboxes import handles as runtime
    from sandboxes import selectors

    selectors._health.clear()
    settings.TVCACHE = {**settings.TVCACHE, "DOCKER_URL": "unix:///tmp/tvcache-no-engine.sock"}
    runtime.sandbox_config.cache_clear()
    try:
        response = api.put("/api/v1/tasks/nodocker", {"env": {"backend": "docker"}}, format="json")
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable"
        lookup = api.post(
            f"/api/v1/tasks/{toy_task}/lookup", {"history": [], "call": {"tool": "x", "args": {}}}, format="json"
        )
        assert lookup.status_code == 200
        assert api.get("/api/v1/pools").json()["engine"]["ok"] is False
    finally:
        runtime.sandbox_config.cache_clear()
        selectors._health.clear()


def test_pre_forks_are_capped_per_task_and_unused_ready_sandboxes_are_stopped(api, docker_task, settings):
    settings.TVCACHE = {**settings.TVCACHE, "PREFORKS_PER_TASK": 1}
    task = docker_task("capped")
    run(api, task, "r", bash("sleep 1; echo a > /a"))
    run(api, task, "r", bash("sleep 1; echo b > /b"))
    assert Snapshot.objects.filter(task_id=task, status="live").count() == 2
    assert Sandbox.objects.filter(task_id=task, pool="fork", rollout=None).count() == 1
    waiting = Sandbox.objects.get(task_id=task, pool="fork", rollout=None)
    services.sandbox_warm(sandbox_id=waiting.pk)  # what the worker does (idempotent if it did already)
    Sandbox.objects.filter(pk=waiting.pk).update(ready_at=timezone.now() - timedelta(hours=1))
    services.sandboxes_reap()
    assert Sandbox.objects.get(pk=waiting.pk).state == "stopped"


@pytest.mark.slow
def test_without_redis_the_service_runs_the_periodic_jobs_itself_one_process_at_a_time(
    api, docker_task, busybox, monkeypatch
):
    """The embedded default: no broker, no beat. The served instance (two processes) reaps an idle
    rollout's sandbox, frees an evicted snapshot and removes an orphan by itself; a job whose
    advisory lock is held elsewhere waits for it."""
    from django.conf import settings
    from django.db import connection

    from lab.server import service_running
    from workers.periodic import job_lock_key

    task = docker_task("embedded-jobs")
    run(api, task, "idle", bash("sleep 1; echo a > /a"))  # slow enough to be snapshotted
    idle = Sandbox.objects.get(rollout__rollout_id="idle")
    Sandbox.objects.filter(pk=idle.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    snapshot = Snapshot.objects.get(task_id=task, status="live")
    Task.objects.filter(pk=task).update(sandbox_budget=0)
    backend = backend_named("docker")
    orphan = backend.start(Task.objects.get(pk=task).env, labels=labels(task, 10**9))
    for name, value in (
        ("TVCACHE_REAP_EVERY_S", "1"),
        ("TVCACHE_COLLECT_EVERY_S", "1"),
        ("TVCACHE_ORPHANS_EVERY_S", "1"),
        ("TVCACHE_ORPHAN_GRACE_S", "0"),
    ):
        monkeypatch.setenv(name, value)
    orphans_lock = job_lock_key("reap-orphans")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock(%s)", [orphans_lock])  # as if another process ran it
    try:
        with service_running(db=settings.DATABASES["default"], redis_url="", workers=2):
            wait_for(lambda: Sandbox.objects.get(pk=idle.pk).state == "stopped", 60)
            wait_for(lambda: Snapshot.objects.get(pk=snapshot.pk).status == "deleted", 60)
            time.sleep(3)  # three rounds of every job, the orphans' held back by the lock
            assert orphan.sandbox_id in {s.id for s in backend.list_sandboxes(labels(task))}
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [orphans_lock])
            wait_for(lambda: orphan.sandbox_id not in {s.id for s in backend.list_sandboxes(labels(task))}, 60)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock_all()")
    with pytest.raises(docker.errors.NotFound):
        busybox.api.inspect_container(idle.ref)
    with pytest.raises(docker.errors.ImageNotFound):
        busybox.images.get(snapshot.ref)
