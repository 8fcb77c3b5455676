"""Tool-server mode answers a miss before its snapshot is taken; the rollout's next miss waits for it."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from rest_framework.test import APIClient

from cache.models import Snapshot
from sandboxes.backends.base import SandboxError
from sandboxes.models import Sandbox
from sandboxes.services import toolserver

from .helpers import bash, run, snapshots_taken

pytestmark = pytest.mark.django_db(transaction=True)

SLOW = bash("sleep 1; mkdir -p /w && cd /w && echo built > out")  # slow: the policy snapshots after it


@pytest.fixture
def held_snapshots(monkeypatch):
    """Snapshots wait for `release` before they start (the thread that takes them is real)."""
    release, started = threading.Event(), threading.Event()
    take = toolserver._snapshot

    def held(run, node_id):
        started.set()
        assert release.wait(120)
        take(run, node_id)

    monkeypatch.setattr(toolserver, "_snapshot", held)
    yield release, started
    release.set()


def _in_thread(token: str, task: str, rollout: str, call: dict, out: dict) -> threading.Thread:
    def go() -> None:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
        try:
            out["answer"] = run(client, task, rollout, call)
        finally:
            connection.close()

    thread = threading.Thread(target=go)
    thread.start()
    return thread


def test_the_answer_comes_before_the_snapshot_and_the_next_miss_waits_for_it(api, token, docker_task, held_snapshots):
    release, started = held_snapshots
    task = docker_task("after")
    first = run(api, task, "r1", SLOW)  # answered while its snapshot waits
    assert first["cached"] is False and first["result"]["stdout"] == ""
    assert started.wait(60) and not Snapshot.objects.filter(task_id=task).exists()
    assert "snapshot" in first["phases_ms"]  # the hand-off only
    # Another rollout's hit needs no sandbox: it is answered meanwhile.
    assert run(api, task, "r2", SLOW)["cached"] is True
    # r1's next miss must not touch the sandbox while the snapshot is pending.
    out: dict = {}
    second = _in_thread(token, task, "r1", bash("cat /w/out; echo more >> /w/out"), out)
    second.join(1.0)
    assert second.is_alive() and "answer" not in out
    release.set()
    second.join(120)
    assert out["answer"]["result"]["stdout"] == "built\n" and out["answer"]["phases_ms"]["snapshot_wait"] > 0
    snapshots_taken()
    snapshot = Snapshot.objects.get(task_id=task, status="live")
    # The snapshot holds the state before r1's second call: a fork of it does not see "more".
    assert run(api, task, "r3", SLOW)["cached"] is True
    assert run(api, task, "r3", bash("cat /w/out"))["result"]["stdout"] == "built\n"
    assert Sandbox.objects.get(rollout__rollout_id="r3", state="leased").snapshot_id == snapshot.pk


@pytest.mark.parametrize("failure", [SandboxError("commit failed"), RuntimeError("the database went away")])
def test_a_failed_snapshot_never_breaks_the_rollout(api, docker_task, monkeypatch, failure):
    take = toolserver._snapshot

    def failing(run, node_id):
        def refused(**labels):
            raise failure

        monkeypatch.setattr(run.sandbox, "snapshot", refused)
        take(run, node_id)

    monkeypatch.setattr(toolserver, "_snapshot", failing)
    task = docker_task("failed")
    assert run(api, task, "r1", SLOW)["cached"] is False
    snapshots_taken()
    assert not Snapshot.objects.filter(task_id=task).exists()
    again = run(api, task, "r1", bash("cat /w/out; pwd"))  # same sandbox, free again
    assert again["cached"] is False and again["result"]["stdout"] == "built\n/w\n"
    assert "snapshot_wait" not in again["phases_ms"]


def test_without_a_reservation_the_snapshot_is_taken_before_the_answer(api, docker_task, monkeypatch):
    from sandboxes.services import reserved

    def no_database():
        raise OSError("the reservations' connection cannot be opened")

    assert reserved.settle()  # the process's reservations connection is closed: the next take opens one
    monkeypatch.setattr(reserved, "_own_connection", no_database)
    task = docker_task("handoff")
    answer = run(api, task, "r1", SLOW)
    assert Snapshot.objects.filter(task_id=task, status="live").count() == 1  # registered before the answer
    assert answer["phases_ms"]["snapshot"] > 0
