"""Real concurrent HTTP requests against a live server."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from accounts.services.tokens import token_create
from cache.models import Node

pytestmark = pytest.mark.django_db(transaction=True)


def test_concurrent_records_of_the_same_path_yield_one_node(live_server):
    token = token_create(name="race")
    headers = {"Authorization": f"Token {token}"}
    base = f"{live_server.url}/api/v1/tasks/race"
    assert httpx.put(base, json={"env": {"n": 1}}, headers=headers).status_code == 201
    history = [{"tool": "write", "args": {"i": i}} for i in range(3)]
    body = {
        "history": history,
        "call": {"tool": "bash", "args": {"command": "make"}},
        "result": {"ok": 1},
        "exec_ms": 5,
    }

    def record(_):
        with httpx.Client(headers=headers, timeout=30) as client:
            response = client.post(f"{base}/record", json=body)
            assert response.status_code == 200, response.text
            return response.json()

    with ThreadPoolExecutor(max_workers=12) as pool:
        outcomes = list(pool.map(record, range(24)))
    assert len({o["node_id"] for o in outcomes}) == 1
    assert sum(o["created"] for o in outcomes) == 1
    assert Node.objects.filter(task_id="race").count() == 1
    stats = httpx.get(f"{base}/stats", headers=headers).json()
    assert stats["executions"] == 1


def test_concurrent_puts_creating_the_same_task_all_succeed(live_server):
    token = token_create(name="put-race")

    def put(n):
        response = httpx.put(
            f"{live_server.url}/api/v1/tasks/put-race",
            json={"env": {"backend": "external", "n": n}},
            headers={"Authorization": f"Token {token}"},
            timeout=30,
        )
        return response.status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        statuses = sorted(pool.map(put, range(8)))
    assert statuses == [200] * 7 + [201], statuses  # one created it, the others updated it
