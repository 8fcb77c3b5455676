"""Under the ASGI server the run command uses, a long miss never holds up other rollouts' hits, nor do
rollouts waiting for it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from unittest.mock import ANY

import httpx
import pytest
from django.conf import settings

from accounts.services.tokens import token_create
from lab.server import service_running
from sandboxes.models import Sandbox
from tests.support.toolserver import bash

pytestmark = pytest.mark.django_db(transaction=True)


@contextmanager
def _rollout_calls(task: str) -> Iterator[tuple[Callable[[str, str], dict], httpx.Client]]:
    """A service as the run command starts it (one process), a rollout's bash call to it and the
    client that sends it."""
    token = token_create(name="asgi")
    with (
        service_running(db=settings.DATABASES["default"], redis_url=settings.REDIS_URL, workers=1) as service,
        httpx.Client(base_url=service.url, headers={"Authorization": f"Token {token}"}, timeout=120) as client,
    ):

        def call(rollout: str, command: str) -> dict:
            response = client.post(f"/api/v1/tasks/{task}/rollouts/{rollout}/calls", json={"call": bash(command)})
            assert response.status_code == 200, response.text
            return response.json()

        yield call, client


@pytest.mark.slow
def test_hits_are_answered_while_another_rollouts_long_miss_runs(busybox, docker_task):
    docker_task("busy")  # made here so that its sandboxes are removed afterwards; the server serves it
    token = token_create(name="asgi")
    headers = {"Authorization": f"Token {token}"}
    with service_running(db=settings.DATABASES["default"], redis_url=settings.REDIS_URL, workers=1) as service:
        base = service.url
        client = httpx.Client(base_url=base, headers=headers, timeout=120)

        def call(rollout: str, command: str) -> dict:
            response = client.post(f"/api/v1/tasks/busy/rollouts/{rollout}/calls", json={"call": bash(command)})
            assert response.status_code == 200, response.text
            return response.json()

        call("first", "echo cached")
        slow = threading.Thread(target=call, args=("slow", "sleep 20; echo done"))
        slow.start()
        while not Sandbox.objects.filter(rollout__rollout_id="slow", state="leased").exists():
            assert slow.is_alive()
            threading.Event().wait(0.1)
        hits = [call(f"quick-{i}", "echo cached") for i in range(5)]
        assert all(hit["cached"] for hit in hits)
        assert slow.is_alive()  # the 20 s miss is still running: the hits did not wait for it
        slow.join()


@pytest.mark.slow
def test_rollouts_waiting_for_another_ones_run_hold_no_thread(busybox, docker_task, monkeypatch):
    """Single flight under load: rollouts that wait for a leader's run of the same call wait on the
    event loop. With two threads for tool runs, a leader and six waiters still leave one thread for
    another rollout's miss, and hits are answered meanwhile."""
    task = docker_task("waiters")
    monkeypatch.setenv("TVCACHE_TOOLSERVER_THREADS", "2")
    with _rollout_calls(task) as (call, client):
        call("first", "echo cached")
        slow = "sleep 15; cat /proc/sys/kernel/random/uuid"  # another answer each time it runs
        with ThreadPoolExecutor(8) as pool:
            leader = pool.submit(call, "leader", slow)
            while not Sandbox.objects.filter(rollout__rollout_id="leader", state="leased").exists():
                assert not leader.done()
                threading.Event().wait(0.1)
            waiters = [pool.submit(call, f"waiter-{i}", slow) for i in range(6)]
            threading.Event().wait(1.0)  # they are waiting by now
            other = call("other", "echo mine")  # a miss of its own: it runs on the second thread
            assert other["cached"] is False and other["result"]["stdout"] == "mine\n"
            hits = [call(f"quick-{i}", "echo cached") for i in range(5)]
            assert all(hit["cached"] for hit in hits)
            assert not leader.done() and not any(w.done() for w in waiters)  # the slow run goes on
            led = leader.result()
            answers = [w.result() for w in waiters]
        assert led["cached"] is False
        assert all(a["cached"] and a["result"] == led["result"] and a["node_id"] == led["node_id"] for a in answers)
        assert all(a["phases_ms"]["wait"] > 0 for a in answers)
        stats = client.get(f"/api/v1/tasks/{task}/stats").json()
        assert stats["executions"] == 3  # first, leader, other: the waiters ran nothing


def test_a_request_handed_back_counts_once_against_its_projects_rate(busybox, docker_task):
    """A tool-server miss starts on a lane that serves hits and is handed on to the lane that runs
    tools (core/lanes.py): it is one request of its project, admitted once."""
    from django.db.models import Sum

    from accounts.models import ProjectRequests
    from cache.ledger import ledger_flush

    def admitted() -> int:
        return ProjectRequests.objects.aggregate(n=Sum("admitted"))["n"] or 0

    task = docker_task("counted")
    token = token_create(name="asgi")
    ledger_flush()  # this process's own requests (the task's PUT) are in the baseline
    before = admitted()
    with (
        service_running(db=settings.DATABASES["default"], redis_url=settings.REDIS_URL, workers=1) as service,
        httpx.Client(base_url=service.url, headers={"Authorization": f"Token {token}"}, timeout=120) as client,
    ):
        answers = [
            client.post(f"/api/v1/tasks/{task}/rollouts/r{i}/calls", json={"call": bash("echo once")}) for i in range(3)
        ]
        assert [a.status_code for a in answers] == [200] * 3
        assert [a.json()["cached"] for a in answers] == [False, True, True]
        pause = threading.Event()
        for _ in range(100):  # the server flushes its counters a few times a second
            if admitted() > before:
                break
            pause.wait(0.1)
        pause.wait(1.0)  # and once more: a second count of the miss would have landed by now
        assert admitted() - before == 3


def test_a_rollout_whose_last_call_missed_is_served_exactly_on_its_next_calls(busybox, docker_task):
    """A rollout whose last call ran its tool starts its next call on the lane that runs tools (a
    guess that it misses again): a hit there is still the recorded answer, unexecuted, and a miss
    runs in the rollout's own state; the count of its project's requests is one per call."""
    task = docker_task("after-miss")
    with _rollout_calls(task) as (call, _):
        first = call("a", "echo one > f; cat /proc/sys/kernel/random/uuid")  # another answer each run
        assert first["cached"] is False
        # b misses on a call of its own, then asks for a's: the recorded answer, not a new run
        assert call("b", "echo hello")["cached"] is False
        again = call("b", "echo one > f; cat /proc/sys/kernel/random/uuid")
        assert again["cached"] is True and again["result"] == first["result"]
        # a misses again, in the state its first call left
        after = call("a", "cat f; echo two >> f; cat f")
        assert after["cached"] is False and after["result"]["stdout"] == "one\none\ntwo\n"
        # and b, which hit a's call, reads the same state from its history (a hit on a's node)
        assert call("b", "cat f; echo two >> f; cat f") == {
            **after,
            "cached": True,
            "latency_ms": ANY,
            "phases_ms": ANY,
        }
