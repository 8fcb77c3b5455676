"""The determinism audit in tool-server mode: a real Celery worker re-executes sampled hits in
real Docker sandboxes at the hit's parent state and compares."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import docker
import pytest

from cache.models import Divergence, Node
from sandboxes.models import Sandbox
from tests.support.toolserver import bash, run, wait_for
from tvcache_site.celery import app as celery_app

pytestmark = pytest.mark.django_db(transaction=True)

RANDOM = bash("head -c 8 /dev/urandom | od -An -tx1")


def audit_sandboxes(task: str):
    return Sandbox.objects.filter(task_id=task, pool="root", rollout=None)  # no pool warmed: the audits' own


def test_a_random_command_is_found_divergent_and_then_no_longer_served(api, docker_task, busybox, celery_worker):
    task = docker_task("audited", audit_rate=1.0)
    setup, read = bash("echo one > /f"), bash("cat /f")
    for call in (setup, read, RANDOM):
        assert run(api, task, "r1", call)["cached"] is False
    first = Node.objects.get(task_id=task, call__args__command=RANDOM["args"]["command"])
    for call in (setup, read, RANDOM):  # every hit is sampled, and audited by the worker
        assert run(api, task, "r2", call)["cached"] is True
    wait_for(lambda: audit_sandboxes(task).filter(state="stopped").count() == 3)
    # An audit stops its sandbox before it compares and records: wait for its verdict too.
    wait_for(lambda: Divergence.objects.filter(task_id=task).exists())

    # The write and the read after it gave what the cache holds; the read's audit replayed the
    # write and found the state the write's node recorded (no divergence of kind "state").
    assert Node.objects.get(task_id=task, call__args__command="echo one > /f").state_shape
    divergence = Divergence.objects.get(task_id=task)
    assert (divergence.node_id, divergence.kind, divergence.tool, divergence.rollout_id) == (
        first.pk,
        "audit",
        "bash",
        "r2",
    )
    assert divergence.expected["stdout"] != divergence.observed["stdout"]
    assert divergence.expected["exit_code"] == divergence.observed["exit_code"] == 0
    assert Node.objects.filter(task_id=task, divergent=True).count() == 1

    assert run(api, task, "r3", setup)["cached"] is True  # the rest of the graph is still served
    again = run(api, task, "r3", RANDOM)  # this node no longer is: executed
    assert (again["cached"], again["node_id"]) == (False, first.pk)
    assert again["result"]["stdout"] != divergence.expected["stdout"]

    stats = api.get(f"/api/v1/tasks/{task}/stats").json()["divergences"]
    assert stats["count"] == 1 and stats["per_tool"][0]["divergent_nodes"] == 1
    assert [row["node_id"] for row in stats["per_node"]] == [first.pk]
    wait_for(lambda: audit_sandboxes(task).filter(state="stopped").count() == 4)  # r3's hit was audited too
    for row in audit_sandboxes(task):  # each audit's sandbox is removed
        with pytest.raises(docker.errors.NotFound):
            busybox.api.inspect_container(row.ref)


def test_a_write_whose_effect_is_random_is_found_divergent_and_nothing_below_it_is_served(
    api, docker_task, busybox, celery_worker
):
    task = docker_task("audited-state", audit_rate=1.0)
    # A write of a random size: its output is always empty, the state it leaves is not (1 in 200,000).
    write = bash("head -c $(( (RANDOM * 32768 + RANDOM) % 200000 + 1 )) /dev/zero > /g")
    read = bash("echo hi")
    for call in (write, read):
        run(api, task, "r1", call)
    assert run(api, task, "r2", write)["cached"] is True
    written = Node.objects.get(task_id=task, call__args__command=write["args"]["command"])
    wait_for(lambda: Node.objects.filter(pk=written.pk, divergent=True).exists())
    wait_for(lambda: audit_sandboxes(task).filter(state="stopped").count() == 1)
    # The write's audit: same output, another state. (Audited one at a time: a hit on the read below
    # it, audited meanwhile, would replay the write, find the state diverged and mark the write
    # divergent first; the write's own audit then skips a node already known divergent.)
    kinds = dict(Divergence.objects.filter(task_id=task).values_list("kind", "node_id"))
    assert kinds == {"audit": written.pk}
    audited = Divergence.objects.get(task_id=task, kind="audit")
    assert audited.expected["state_shape"] == written.state_shape != audited.observed["state_shape"]
    assert list(Node.objects.filter(task_id=task, divergent=True).values_list("pk", flat=True)) == [written.pk]
    # Neither the write nor anything after it is served any more.
    assert run(api, task, "r3", write)["cached"] is False
    assert run(api, task, "r3", read)["cached"] is False


@contextmanager
def broker_down():
    """The project's Celery app pointed at a port nothing listens on, as if Redis were down; its
    connection and producer pools are put back as they were afterwards."""
    saved = celery_app.conf.broker_url, celery_app._pool, celery_app.amqp._producer_pool
    celery_app.conf.broker_url, celery_app._pool, celery_app.amqp._producer_pool = "redis://127.0.0.1:9/0", None, None
    try:
        yield
    finally:
        celery_app.conf.broker_url, celery_app._pool, celery_app.amqp._producer_pool = saved


def test_a_hit_whose_audit_cannot_be_queued_is_served(api, caplog):
    api.put(
        "/api/v1/tasks/files-audit",
        {"env": {"backend": "directory", "files": {"a.txt": "A"}}, "audit_rate": 1.0},
        format="json",
    )
    read = {"tool": "read_file", "args": {"path": "a.txt"}}
    assert run(api, "files-audit", "r1", read)["cached"] is False
    with broker_down(), caplog.at_level(logging.WARNING, logger="tvcache.background"):
        hit = run(api, "files-audit", "r2", read)
        assert (hit["cached"], hit["result"]) == (True, {"output": "A", "ok": True})
        wait_for(lambda: "could not queue workers.tasks.hit_audit" in caplog.text)  # the outbox's thread tried
    assert run(api, "files-audit", "r3", read)["cached"] is True  # and the broker is back for the rest
