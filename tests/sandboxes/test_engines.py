"""Sandboxes across two Docker engines (TVCACHE_DOCKER_ENGINES): the machine's engine, listed
first, and a dockerd of the test's own (tests/sandboxes/dockerd.py). Fresh sandboxes are placed by
load, forks go to the engine holding their snapshot's image, every engine runs the first engine's
images, an engine that goes away takes only its own sandboxes with it, and background work on an
engine's sandboxes goes to the Celery queue of the workers next to it."""

from __future__ import annotations

import os
from collections import Counter

import pytest

from cache.models import Snapshot
from core.background import job_queue
from sandboxes import handles as runtime
from sandboxes import selectors, services
from sandboxes.engines import engine_named
from sandboxes.models import Sandbox
from tests.support.toolserver import bash, run, wait_for, worker_on
from workers.tasks import sandbox_warm

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.docker]

MAIN = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


@pytest.fixture
def two_engines(second_engine, busybox, settings):
    """The machine's engine and the second one, four sandboxes each; no pre-forks (their warm-ups
    would wait in engine queues no worker of these tests consumes)."""
    settings.TVCACHE = {
        **settings.TVCACHE,
        "DOCKER_ENGINES": [f"{MAIN}=4", f"{second_engine.url}=4"],
        "PREFORKS_PER_TASK": 0,
    }
    runtime.sandbox_config.cache_clear()
    selectors._health.clear()
    yield second_engine
    runtime.sandbox_config.cache_clear()
    selectors._health.clear()


def engines_of(task: str, state: str = "leased") -> Counter:
    return Counter(Sandbox.objects.filter(task_id=task, state=state).values_list("engine", flat=True))


def test_placement_by_load_forks_on_the_snapshot_engine_and_a_lost_engine_takes_only_its_sandboxes(
    api, docker_task, two_engines, busybox
):
    second = two_engines.url
    task = docker_task("spread")
    for rollout in ("r0", "r1", "r2", "r3"):
        assert run(api, task, rollout, bash(f"echo {rollout} > /f"))["cached"] is False
    assert engines_of(task) == {MAIN: 2, second: 2}
    assert {
        row.rollout.rollout_id: row.engine for row in Sandbox.objects.filter(task_id=task).select_related("rollout")
    } == {"r0": MAIN, "r1": second, "r2": MAIN, "r3": second}
    assert len(two_engines.client().containers.list()) == 2
    # The second engine runs the first engine's image (moved there by id), not its own build.
    base = busybox.images.get("tvcache/busybox:latest").id
    assert {container.image.id for container in two_engines.client().containers.list()} == {base}

    # A snapshot is taken on the engine of its sandbox (the main one: a tie goes to the first
    # listed); its fork goes there too, though the other engine holds fewer sandboxes by now.
    setup = bash("sleep 1; echo built > /a")
    run(api, task, "s", setup)
    snapshot = Snapshot.objects.get(task_id=task, status="live")
    assert snapshot.engine == MAIN and engines_of(task) == {MAIN: 3, second: 2}
    run(api, task, "f", setup)
    assert run(api, task, "f", bash("cat /a"))["result"]["stdout"] == "built\n"
    fork = Sandbox.objects.get(rollout__rollout_id="f")
    assert (fork.pool, fork.snapshot_id, fork.engine) == ("fork", snapshot.pk, MAIN)

    two_engines.stop()
    gone = api.post(f"/api/v1/tasks/{task}/rollouts/r1/calls", {"call": bash("echo again >> /f")}, format="json")
    assert gone.status_code == 503 and gone.json()["error"]["code"] == "sandbox_gone", gone.content
    assert run(api, task, "r0", bash("echo more >> /f; cat /f"))["result"]["stdout"] == "r0\nmore\n"
    # The second engine holds the fewest sandboxes now, but it failed: new ones go to the main one.
    assert run(api, task, "r9", bash("echo r9 > /f; cat /f"))["result"]["stdout"] == "r9\n"
    assert Sandbox.objects.get(rollout__rollout_id="r9").engine == MAIN
    # r1 goes on from its history in a fresh sandbox on the engine that is left.
    assert run(api, task, "r1", bash("echo again >> /f; cat /f"))["result"]["stdout"] == "r1\nagain\n"
    assert Sandbox.objects.get(rollout__rollout_id="r1", state="leased").engine == MAIN
    pools = api.get("/api/v1/pools").json()
    assert pools["engine"]["ok"] is False
    assert {(entry["url"], entry["ok"], entry["capacity"]) for entry in pools["engines"]} == {
        (MAIN, True, 4),
        (second, False, 4),
    }


def test_warming_an_engine_sandbox_is_queued_for_the_workers_next_to_that_engine(docker_task, two_engines):
    task = docker_task("queues")
    first, second = (engine_named(MAIN), engine_named(two_engines.url))
    main_queue, second_queue = job_queue(sandbox_warm, first.queue), job_queue(sandbox_warm, second.queue)
    try:
        services.pool_request(task_id=task, roots=2)
        assert engines_of(task, "warming") == {MAIN: 1, two_engines.url: 1}
        with worker_on([second_queue]):
            wait_for(lambda: engines_of(task, "ready") == {two_engines.url: 1})
        assert engines_of(task, "warming") == {MAIN: 1}  # its job waits for a worker next to the main engine
        with worker_on([main_queue]):
            wait_for(lambda: engines_of(task, "ready") == {MAIN: 1, two_engines.url: 1})
    finally:
        for row in Sandbox.objects.filter(task_id=task):
            services.sandbox_stop(sandbox_id=row.pk)
        with sandbox_warm.app.connection_for_write() as connection:
            for queue in (main_queue, second_queue):
                connection.default_channel.queue_delete(queue)
