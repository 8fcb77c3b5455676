"""Work after the answer (tool-server mode): a miss is answered before its snapshot is taken, and a
rollout's sandbox catches up after a state-changing hit; the rollout's next miss waits for either."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection
from rest_framework.test import APIClient

from cache.models import Snapshot
from sandboxes.backends.base import SandboxError
from sandboxes.models import Sandbox
from sandboxes.services import misses, reserved
from sandboxes.services.reserved import settle
from tests.support.toolserver import bash, run

pytestmark = pytest.mark.django_db(transaction=True)

SLOW = bash("sleep 1; mkdir -p /w && cd /w && echo built > out")  # slow: the policy snapshots after it


@pytest.fixture
def held_snapshots(monkeypatch):
    """Snapshots wait for `release` before they start (the thread that takes them is real)."""
    release, started = threading.Event(), threading.Event()
    take = misses.snapshot_take

    def held(run, node_id):
        started.set()
        assert release.wait(120)
        take(run, node_id)

    monkeypatch.setattr(misses, "snapshot_take", held)
    yield release, started
    release.set()
    assert settle()


def _in_thread(token: str, task: str, rollout: str, call: dict, out: dict) -> threading.Thread:
    def go() -> None:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
        try:
            out["answer"] = run(client, task, rollout, call, settled=False)
        finally:
            connection.close()

    thread = threading.Thread(target=go)
    thread.start()
    return thread


def test_the_answer_comes_before_the_snapshot_and_the_next_miss_waits_for_it(api, token, docker_task, held_snapshots):
    release, started = held_snapshots
    task = docker_task("after")
    first = run(api, task, "r1", SLOW, settled=False)  # answered while its snapshot waits
    assert first["cached"] is False and first["result"]["stdout"] == ""
    assert started.wait(60) and not Snapshot.objects.filter(task_id=task).exists()
    assert "snapshot" in first["phases_ms"]  # the hand-off only
    # Another rollout's hit needs no sandbox: it is answered meanwhile.
    assert run(api, task, "r2", SLOW, settled=False)["cached"] is True
    # r1's next miss must not touch the sandbox while its snapshot is pending.
    out: dict = {}
    second = _in_thread(token, task, "r1", bash("cat /w/out; echo more >> /w/out"), out)
    second.join(1.0)
    assert second.is_alive() and "answer" not in out
    release.set()
    second.join(120)
    assert out["answer"]["result"]["stdout"] == "built\n" and out["answer"]["phases_ms"]["background_wait"] > 0
    assert settle()
    snapshot = Snapshot.objects.get(task_id=task, status="live")
    # The snapshot holds the state before r1's second call: a fork of it does not see "more".
    assert run(api, task, "r3", SLOW)["cached"] is True
    assert run(api, task, "r3", bash("cat /w/out"))["result"]["stdout"] == "built\n"
    assert Sandbox.objects.get(rollout__rollout_id="r3", state="leased").snapshot_id == snapshot.pk


@pytest.mark.parametrize("failure", [SandboxError("commit failed"), RuntimeError("the database went away")])
def test_a_failed_snapshot_never_breaks_the_rollout(api, docker_task, monkeypatch, failure):
    take = misses.snapshot_take

    def failing(run, node_id):
        def refused(**labels):
            raise failure

        monkeypatch.setattr(run.sandbox, "snapshot", refused)
        take(run, node_id)

    monkeypatch.setattr(misses, "snapshot_take", failing)
    task = docker_task("failed")
    assert run(api, task, "r1", SLOW)["cached"] is False
    assert not Snapshot.objects.filter(task_id=task).exists()
    again = run(api, task, "r1", bash("cat /w/out; pwd"))  # the same sandbox, free again
    assert again["cached"] is False and again["result"]["stdout"] == "built\n/w\n"
    assert "background_wait" not in again["phases_ms"]


def test_a_state_changing_hit_is_replayed_in_the_rollouts_sandbox_after_the_answer(api, docker_task):
    task = docker_task("catch-up")
    first, second = bash("echo 1 > /a"), bash("echo 2 >> /a")
    run(api, task, "r1", first)
    run(api, task, "r1", second)
    assert run(api, task, "r2", first)["cached"] is True
    read = run(api, task, "r2", bash("cat /a"))  # r2's sandbox: forked or replayed to the first write
    assert (read["cached"], read["result"]["stdout"]) == (False, "1\n")
    row = Sandbox.objects.get(rollout__rollout_id="r2", state="leased")
    assert row.applied == 1
    assert run(api, task, "r2", second)["cached"] is True  # its sandbox replays it after the answer
    row.refresh_from_db()
    assert (row.applied, row.executing) == (2, False)
    after = run(api, task, "r2", bash("cat /a; echo 3 >> /a"))
    assert (after["cached"], after["result"]["stdout"]) == (False, "1\n2\n")
    assert "replay" not in after["phases_ms"]  # nothing left to catch up on the critical path
    assert Sandbox.objects.get(rollout__rollout_id="r2", state="leased").pk == row.pk


def test_a_rollout_that_hits_a_slow_call_catches_up_by_forking_its_snapshot(api, docker_task):
    """Replaying SLOW (a second) costs more than restoring its snapshot: the sandbox of a rollout
    that hit it is replaced by a fork of that snapshot, verified, while the policy thinks."""
    task = docker_task("catch-up-fork")
    assert run(api, task, "r2", bash("ls /"))["cached"] is False  # read-only: r2 has a root sandbox, no history
    own = Sandbox.objects.get(rollout__rollout_id="r2", state="leased")
    assert run(api, task, "r1", SLOW)["cached"] is False
    snapshot = Snapshot.objects.get(task_id=task, status="live")
    assert run(api, task, "r2", SLOW)["cached"] is True
    own.refresh_from_db()
    fork = Sandbox.objects.get(rollout__rollout_id="r2", state="leased")
    assert own.state == "stopped" and (fork.pool, fork.snapshot_id, fork.applied, fork.executing) == (
        "fork",
        snapshot.pk,
        1,
        False,
    )
    after = run(api, task, "r2", bash("cat /w/out; pwd"))
    assert (after["cached"], after["result"]["stdout"]) == (False, "built\n/w\n")
    assert "replay" not in after["phases_ms"] and "materialize" not in after["phases_ms"]


def test_a_rollout_without_a_sandbox_waits_for_the_snapshot_being_taken_rather_than_replay(
    api, token, docker_task, held_snapshots
):
    """r2 misses right after r1's slow call, while its snapshot is being taken: replaying the call
    costs more than restoring, so r2 waits for the snapshot (up to the difference) and forks it."""
    release, started = held_snapshots
    task = docker_task("snapshot-wait")
    slower = bash("sleep 3; mkdir -p /w && cd /w && echo built > out")
    assert run(api, task, "r1", slower, settled=False)["cached"] is False
    assert started.wait(60)
    assert run(api, task, "r2", slower, settled=False)["cached"] is True  # r2 has no sandbox: nothing to catch up
    out: dict = {}
    miss = _in_thread(token, task, "r2", bash("cat /w/out"), out)
    miss.join(0.5)
    assert miss.is_alive()  # waiting for the snapshot, not replaying SLOW
    release.set()
    miss.join(120)
    answer = out["answer"]
    assert (answer["cached"], answer["result"]["stdout"]) == (False, "built\n")
    assert answer["phases_ms"]["snapshot_wait"] > 0
    assert settle()
    snapshot = Snapshot.objects.get(task_id=task, status="live")
    assert Sandbox.objects.get(rollout__rollout_id="r2", state="leased").snapshot_id == snapshot.pk


@pytest.mark.parametrize("window", ["reserved", "listed"])
def test_settling_waits_for_a_hand_off_another_request_is_making(monkeypatch, window):
    """A hand-off under way in another request is work under way: the settle of another request
    (the tests' check before they look at the graph) waits for it, whether the hand-off has taken
    its reservation only or has listed its thread too, not started yet."""
    ran = threading.Event()
    thread_class, ask = reserved.threading.Thread, reserved._holder.ask
    if window == "reserved":

        def slow_ask(action, key=0):
            answer = ask(action, key)
            if action == "take":
                time.sleep(0.5)
            return answer

        monkeypatch.setattr(reserved._holder, "ask", slow_ask)
    else:

        class SlowToStart(thread_class):
            def start(self):
                time.sleep(0.5)
                super().start()

        monkeypatch.setattr(reserved.threading, "Thread", SlowToStart)
    handing_off = thread_class(target=reserved.run_reserved, args=(987654, ran.set), kwargs={"name": "test"})
    handing_off.start()
    deadline = time.monotonic() + 30
    while reserved.wait_unreserved(987654, timeout_s=0) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not ran.is_set()  # reserved, its work not started
    assert settle(timeout_s=30)
    assert ran.is_set()
    handing_off.join(30)
    connection.close()
