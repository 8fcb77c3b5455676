"""Faults degrade, never break: a served instance (lab/server.py, production
settings, the deployed ASGI application) against the real PostgreSQL, Redis and Docker engine.
Nothing shared is stopped: PostgreSQL "restarts" by having the served instance's connections
terminated, Redis is "down" for an instance pointed at a port where nothing listens."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import psycopg
import pytest
from django.conf import settings
from django.db import connection

from cache.models import ToolStat
from cache.services import kept_history
from lab.server import ROOT, database_url, free_port, service_running
from sandboxes.models import Sandbox
from tests.support.api import call, record, wait_for, waiting_on_locks

pytestmark = pytest.mark.django_db(transaction=True)

W = call("write", path="f", content="1")


def lookup_of(client: httpx.Client, c: dict = W) -> httpx.Response:
    return client.post("/api/v1/tasks/toy/lookup", json={"history": [], "call": c})


def test_postgresql_dropping_its_connections_answers_503_and_the_service_recovers(api, toy_task, token):
    record(api, "toy", [], W, {"ok": True})
    db = settings.DATABASES["default"]
    with (
        service_running(db=db, workers=1) as service,
        httpx.Client(base_url=service.url, headers={"Authorization": f"Token {token}"}, timeout=60) as client,
    ):
        assert lookup_of(client).json()["hit"] is True  # the lookup thread holds a connection now
        assert client.get("/api/v1/tasks/toy").status_code == 200

        # Two requests in flight (a hot-path lookup, a Django view) wait for a lock when every
        # connection of the service is terminated, as a PostgreSQL restart would. The lookup is a
        # miss: the hit above may be served again from the process's cache, without the database.
        with psycopg.connect(database_url(db)) as blocker, ThreadPoolExecutor(2) as pool:
            blocker.execute("LOCK TABLE cache_node, cache_task IN ACCESS EXCLUSIVE MODE")
            in_flight = [
                pool.submit(lookup_of, client, call("write", path="g", content="2")),
                pool.submit(client.get, "/api/v1/tasks/toy"),
            ]
            wait_for(lambda: waiting_on_locks(db["NAME"]) == 2, what="two requests waiting")
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid() AND pid <> %s",
                    [db["NAME"], blocker.info.backend_pid],
                )
                assert cursor.fetchone()[0] >= 2
            answers = [future.result() for future in in_flight]
            blocker.rollback()
        for answer in answers:
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "database_unavailable"
            assert answer.headers["Retry-After"] == "1"
        # It recovers by itself: each connection that died answers at most once more, then all is served.
        seen = []
        for _ in range(20):
            seen += [lookup_of(client).status_code, client.get("/api/v1/tasks/toy").status_code]
            if seen[-2:] == [200, 200]:
                break
        assert set(seen) <= {200, 503} and seen[-2:] == [200, 200], seen
        assert all(lookup_of(client).json()["hit"] for _ in range(10))
        # The counters' flush thread (its connection died too) writes them again by itself: no
        # request reads stats (that would flush them) from here on.
        served = 1 + seen[::2].count(200) + 10
        wait_for(
            lambda: ToolStat.objects.get(task_id="toy", tool="write").calls == served, 30, f"{served} lookups counted"
        )


def test_a_request_with_a_bad_token_is_refused_before_its_body_is_sent(toy_task, token):
    with service_running(db=settings.DATABASES["default"], workers=1) as service:
        port = int(service.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(
                b"POST /api/v1/tasks/toy/lookup HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Authorization: Token wrong\r\nContent-Type: application/json\r\n"
                b"Content-Length: 2097152\r\n\r\n" + b" " * 65536
            )  # 64 KiB of the 2 MiB declared
            answer = b""  # the rest of the body is never sent: the answer comes without it
            while b'"code"' not in answer:
                chunk = sock.recv(65536)
                assert chunk, answer
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
        assert b'"code":"invalid_token"' in answer
        # A valid token this process has not verified yet is checked first as well, then served.
        response = httpx.post(
            service.url + "/api/v1/tasks/toy/lookup",
            headers={"Authorization": f"Token {token}"},
            json={"history": [], "call": W},
            timeout=30,
        )
        assert response.status_code == 200 and response.json()["hit"] is False


@pytest.fixture
def docker_engine():
    import docker

    from sandboxes.images import build_busybox_image

    client = docker.from_env()
    client.ping()  # a missing engine fails the run
    build_busybox_image(client)
    return client


@pytest.mark.slow
@pytest.mark.docker
def test_with_redis_down_a_tool_server_miss_that_queues_work_answers_and_the_work_runs_in_process(docker_engine, token):
    from sandboxes.handles import backend_named, labels

    nowhere = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    task = "redis-down"
    try:
        with (
            service_running(db=settings.DATABASES["default"], redis_url=nowhere, workers=1) as service,
            httpx.Client(base_url=service.url, headers={"Authorization": f"Token {token}"}, timeout=120) as client,
        ):
            put = client.put(f"/api/v1/tasks/{task}", json={"env": {"backend": "docker"}, "sandbox_budget": 8})
            assert put.status_code == 201, put.text
            # Slow enough to be snapshotted: the snapshot asks for a pre-fork, a job for a worker.
            miss = client.post(
                f"/api/v1/tasks/{task}/rollouts/r1/calls",
                json={"call": {"tool": "bash", "args": {"command": "sleep 1; echo built > /artifact"}}},
            )
            assert miss.status_code == 200, miss.text
            assert miss.json()["cached"] is False and miss.json()["node_id"] is not None
            # The broker refused the job: the service ran it itself.
            wait_for(
                lambda: Sandbox.objects.filter(task_id=task, pool="fork", state="ready").exists(),
                120,
                "a pre-fork warmed in process",
            )
            assert client.delete(f"/api/v1/tasks/{task}/rollouts/r1").status_code == 204
    finally:
        backend = backend_named("docker")
        for sandbox in backend.list_sandboxes(labels(task)):
            backend.remove_sandbox(sandbox.id)
        for snapshot in backend.list_snapshots(labels(task)):
            backend.delete_snapshot(snapshot.id)


def serve(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", "serve", "--web-only", "--port", str(free_port())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_without_a_secret_key_production_settings_refuse_to_start():
    env = {key: value for key, value in os.environ.items() if key != "SECRET_KEY"}
    env.update(DJANGO_SETTINGS_MODULE="tvcache_site.settings", DEBUG="0")
    refused = serve(env)
    assert refused.returncode != 0 and "SECRET_KEY is not set" in refused.stderr
    check = [sys.executable, "manage.py", "check"]
    debug = subprocess.run(check, cwd=ROOT, env={**env, "DEBUG": "1"}, capture_output=True, text=True, timeout=60)
    assert debug.returncode == 0, debug.stderr  # development keeps its obvious development key
    with_key = subprocess.run(
        check, cwd=ROOT, env={**env, "SECRET_KEY": "k" * 50}, capture_output=True, text=True, timeout=60
    )
    assert with_key.returncode == 0, with_key.stderr


@pytest.mark.slow
def test_with_redis_down_lookups_records_and_tool_server_calls_keep_answering(api, toy_task, token):
    """A served instance whose broker and channel layer point where nothing listens. Every answer
    within the client's 10 s (a publish to a dead broker took 6.6 s when it was on the path)."""
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    db = settings.DATABASES["default"]
    with (
        service_running(db=db, redis_url=nowhere, workers=1) as service,
        httpx.Client(base_url=service.url, headers={"Authorization": f"Token {token}"}, timeout=10) as client,
    ):
        lookup = client.post("/api/v1/tasks/toy/lookup", json={"history": [], "call": W})
        assert lookup.status_code == 200 and lookup.json()["hit"] is False
        recorded = client.post(
            "/api/v1/tasks/toy/record", json={"history": [], "call": W, "result": {"ok": True}, "exec_ms": 60_000.0}
        )
        assert recorded.status_code == 200 and recorded.json()["snapshot"] == "wanted", recorded.text
        registered = client.post(
            f"/api/v1/tasks/toy/nodes/{recorded.json()['node_id']}/snapshots",
            json={"ref": "client-snap-1", "backend": "external"},
        )
        assert registered.status_code in (200, 201), registered.text
        assert client.post("/api/v1/tasks/toy/lookup", json={"history": [], "call": W}).json()["hit"] is True
        # Tool-server mode on folder sandboxes; every hit audited (a job for a worker), and a step
        # announced (warm-ups for a worker): with the broker down they run in process or are dropped.
        put = client.put(
            "/api/v1/tasks/folders",
            json={"env": {"backend": "directory"}, "audit_rate": 1.0, "tools": {"read_file": {"mutates_state": False}}},
        )
        assert put.status_code == 201, put.text
        write = {"tool": "write_file", "args": {"path": "a", "content": "1"}}
        read = {"tool": "read_file", "args": {"path": "a"}}
        for rollout in ("r1", "r2"):
            for tool_call in (write, read):
                answer = client.post(f"/api/v1/tasks/folders/rollouts/{rollout}/calls", json={"call": tool_call})
                assert answer.status_code == 200, answer.text
                assert answer.json()["cached"] is (rollout == "r2")
        assert answer.json()["result"]["output"] == "1"
        step = client.post("/api/v1/steps", json={"tasks": ["folders"], "rollouts_per_task": 2, "epoch": 1})
        assert step.status_code == 202, step.text
        wait_for(
            lambda: Sandbox.objects.filter(task_id="folders", pool="root", state="ready").count() == 2,
            60,
            "root sandboxes warmed in process",
        )
        assert client.delete("/api/v1/tasks/folders/rollouts/r1").status_code == 204
        stats = client.get("/api/v1/tasks/folders")
        assert stats.status_code == 200 and stats.json()["stats"]["hits"] == 2, stats.text


def test_sigkill_of_the_worker_then_of_the_server_mid_load_loses_no_acknowledged_write(api, toy_task, token):
    """Records and tool-server calls (folder sandboxes, steps announced: jobs for the worker) from
    four clients; the Celery worker is killed (SIGKILL, its whole tree) mid-load, then the web
    server. Every write the service acknowledged is in PostgreSQL, and a new server serves it."""
    import threading

    from cache.models import Node, Rollout
    from lab.server import crash

    assert api.put("/api/v1/tasks/folders", {"env": {"backend": "directory"}}, format="json").status_code == 201
    db = settings.DATABASES["default"]
    records: list[tuple[dict, int]] = []  # (call, node id) acknowledged
    calls: dict[str, list[dict]] = {}  # rollout -> its acknowledged calls, in order
    stop = threading.Event()

    def load(client: httpx.Client, index: int) -> None:
        rollout, n = f"t{index}", 0
        calls[rollout] = []
        while not stop.is_set():
            n += 1
            written = call("write", path=f"{index}-{n}", content="x")
            write = {"tool": "write_file", "args": {"path": f"f{n}", "content": str(n)}}
            try:
                answer = client.post(
                    "/api/v1/tasks/toy/record",
                    json={"history": [W], "call": written, "result": {"ok": n}, "exec_ms": 1.0},
                )
                if answer.status_code == 200:
                    records.append((written, answer.json()["node_id"]))
                answer = client.post(f"/api/v1/tasks/folders/rollouts/{rollout}/calls", json={"call": write})
                if answer.status_code == 200:
                    calls[rollout].append(write)
                if n % 5 == 0:
                    client.post("/api/v1/steps", json={"tasks": ["folders"], "rollouts_per_task": 2, "epoch": n})
            except httpx.TransportError:  # cut off by the crash: not acknowledged
                pass

    with service_running(db=db, workers=2, celery=True) as service:
        clients = [
            httpx.Client(base_url=service.url, headers={"Authorization": f"Token {token}"}, timeout=30)
            for _ in range(4)
        ]
        threads = [threading.Thread(target=load, args=(client, i)) for i, client in enumerate(clients)]
        for thread in threads:
            thread.start()
        wait_for(lambda: len(records) >= 20, 60, "twenty records")
        crash(service.worker_pid)
        acknowledged = len(records)
        wait_for(lambda: len(records) >= acknowledged + 20, 60, "twenty records without the worker")
        crash(service.pid)
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    assert sum(map(len, calls.values())) >= 20
    nodes = dict(Node.objects.filter(pk__in=[node for _, node in records]).values_list("pk", "tool"))
    assert len(nodes) == len(records)  # every acknowledged record is there
    for rollout, acknowledged_calls in calls.items():
        row = Rollout.objects.get(task_id="folders", rollout_id=rollout)
        history = [call.to_json() for call in kept_history(row.pk, row.history_length)]
        assert history[: len(acknowledged_calls)] == acknowledged_calls  # and every acknowledged call, in order
        assert len(history) - len(acknowledged_calls) <= 1  # at most the one cut off
    with (
        service_running(db=db, workers=1, release_on_stop=True) as service,
        httpx.Client(base_url=service.url, headers={"Authorization": f"Token {token}"}, timeout=30) as client,
    ):
        for written, node_id in records:
            hit = client.post("/api/v1/tasks/toy/lookup", json={"history": [W], "call": written}).json()
            assert hit["hit"] is True and hit["node_id"] == node_id
        for rollout, acknowledged_calls in calls.items():  # each rollout goes on where it was
            last = acknowledged_calls[-1]["args"]["path"]
            read = client.post(
                f"/api/v1/tasks/folders/rollouts/{rollout}/calls",
                json={"call": {"tool": "read_file", "args": {"path": last}}},
            )
            assert read.status_code == 200 and read.json()["result"]["output"] == last[1:], read.text
