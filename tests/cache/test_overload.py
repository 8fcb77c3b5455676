"""Overload answers 503, never a pile-up: a served instance (production settings, the
deployed ASGI application) whose lanes are made to stall by a table lock held by the test, the way
a slow disk or a saturated database would stall them."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psycopg
import pytest
from django.conf import settings

from lab.server import database_url, service_running
from tests.support.api import call, record, wait_for, waiting_on_locks

pytestmark = pytest.mark.django_db(transaction=True)

W = call("write", path="f", content="1")
W2 = call("write", path="g", content="2")


def test_a_full_lane_answers_503_overloaded_at_once_and_the_queued_requests_are_served(
    api, toy_task, token, monkeypatch
):
    record(api, "toy", [], W, {"ok": True})
    record(api, "toy", [], W2, {"ok": 2})
    monkeypatch.setenv("TVCACHE_HOT_PATH_THREADS", "1")
    monkeypatch.setenv("TVCACHE_LANE_QUEUE", "2")
    db = settings.DATABASES["default"]
    with (
        service_running(db=db, workers=1) as service,
        httpx.Client(base_url=service.url, headers={"Authorization": f"Token {token}"}, timeout=60) as client,
    ):

        def lookup(c: dict = W) -> httpx.Response:
            return client.post("/api/v1/tasks/toy/lookup", json={"history": [], "call": c})

        assert lookup().json()["hit"] is True  # the token is verified, the task handle cached
        with psycopg.connect(database_url(db)) as blocker, ThreadPoolExecutor(3) as pool:
            blocker.execute("LOCK TABLE cache_node IN ACCESS EXCLUSIVE MODE")
            # The lane's thread waits for the lock (a hit this process has not served yet: the one
            # above may be served again from its cache, on the event loop, without the lane) ...
            stalled = [pool.submit(lookup, W2)]
            wait_for(lambda: waiting_on_locks(db["NAME"]) == 1, what="a lookup waiting for the lock")
            stalled += [pool.submit(lookup, W2), pool.submit(lookup, W2)]  # ... and two wait for the thread
            time.sleep(0.5)  # (they are in the lane's queue by then: nothing else to wait for)
            refused = lookup(W2)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "overloaded"
            assert refused.headers["Retry-After"] == "1"
            assert not any(future.done() for future in stalled)
            blocker.rollback()
            assert [future.result().json()["hit"] for future in stalled] == [True] * 3
        assert lookup().status_code == 200  # the lane took requests again once it drained


def test_a_flood_of_large_bodies_with_bad_tokens_never_holds_up_lookups(api, toy_task, token, monkeypatch):
    record(api, "toy", [], W, {"ok": True})
    monkeypatch.setenv("TVCACHE_LANE_QUEUE", "8")
    db = settings.DATABASES["default"]
    with (
        service_running(db=db, workers=1) as service,
        httpx.Client(base_url=service.url, headers={"Authorization": f"Token {token}"}, timeout=60) as client,
    ):
        assert client.post("/api/v1/tasks/toy/lookup", json={"history": [], "call": W}).json()["hit"] is True
        port = int(service.url.rsplit(":", 1)[1])

        def flood(index: int) -> bytes:
            """A 2 MiB body declared, 64 KiB of it sent; the answer comes without the rest."""
            token_header = b"Authorization: Token wrong\r\n" if index % 2 else b""
            with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
                sock.sendall(
                    b"POST /api/v1/tasks/toy/lookup HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    + token_header
                    + b"Content-Type: application/json\r\nContent-Length: 2097152\r\n\r\n"
                    + b" " * 65536
                )
                answer = b""
                while b'"code"' not in answer:
                    chunk = sock.recv(65536)
                    assert chunk, answer
                    answer += chunk
                return answer

        # Checking a token this process has not seen reads the token table: held here, every such
        # check stalls, as under a flood of them.
        with psycopg.connect(database_url(db)) as blocker, ThreadPoolExecutor(48) as pool:
            blocker.execute("LOCK TABLE accounts_apitoken IN ACCESS EXCLUSIVE MODE")
            flooded = [pool.submit(flood, index) for index in range(48)]
            wait_for(lambda: waiting_on_locks(db["NAME"]) == 1, what="a token check waiting for the lock")
            without_token = [flooded[i].result() for i in range(0, 48, 2)]  # refused without the database
            assert all(a.startswith(b"HTTP/1.1 401 ") and b'"not_authenticated"' in a for a in without_token)
            for _ in range(20):  # lookups with a verified token go on meanwhile
                response = client.post("/api/v1/tasks/toy/lookup", json={"history": [], "call": W})
                assert response.status_code == 200 and response.json()["hit"] is True
            # The checks' lane holds its thread and 8 more; the rest were refused at once.
            wait_for(lambda: sum(f.done() for f in flooded[1::2]) >= 24 - 9, what="the lane's overflow refused")
            time.sleep(0.3)
            overloaded = [f.result() for f in flooded[1::2] if f.done()]
            assert len(overloaded) == 24 - 9
            assert all(a.startswith(b"HTTP/1.1 503 ") and b'"overloaded"' in a for a in overloaded)
            assert b"retry-after: 1" in overloaded[0].lower()
            blocker.rollback()
            checked = [f.result() for f in flooded[1::2]]
            assert sum(a.startswith(b"HTTP/1.1 401 ") and b'"invalid_token"' in a for a in checked) == 9
