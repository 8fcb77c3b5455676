import asyncio
import contextlib
import gc
import json
import threading

import httpx
import pytest

from tvclient import (
    AsyncTVCacheClient,
    LookupResult,
    Resume,
    TVCacheClient,
    TVCacheError,
    TVCacheUnavailable,
)
from tvclient.transport import server_ms

from .fake_service import call
from .loopback import served

BASE = "http://tvcache.test"


class Server:
    """Answers every request with one canned response and keeps the requests."""

    def __init__(self, status: int = 200, body=None, content: bytes | None = None) -> None:
        self.status, self.body, self.content = status, body, content
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.content is not None:
            return httpx.Response(self.status, content=self.content)
        if self.body is None:
            return httpx.Response(self.status)
        return httpx.Response(self.status, json=self.body)


@contextlib.contextmanager
def sync_client(server):
    with served(server) as url, TVCacheClient(url, "secret") as client:
        yield client


def test_put_task_sends_the_task_with_the_token():
    server = Server(201, {"task_id": "a/b", "env_fingerprint": "f00"})
    tools = {"get": {"mutates_state": False, "cacheable": True}}

    with sync_client(server) as client:
        task = client.put_task("a/b", {"backend": "external"}, tools, sandbox_budget=4)

    assert task["env_fingerprint"] == "f00"
    (request,) = server.requests
    assert (request.method, request.url.raw_path) == ("PUT", b"/api/v1/tasks/a%2Fb")
    assert request.headers["Authorization"] == "Token secret"
    assert json.loads(request.content) == {
        "env": {"backend": "external"},
        "tools": tools,
        "sandbox_budget": 4,
    }


def test_lookup_miss_is_read_into_a_resume():
    replay = [call("set", key="a", value="1")]
    server = Server(
        body={
            "hit": False,
            "matched": 2,
            "resume": {
                "node_id": 3,
                "snapshot_id": 4,
                "snapshot_ref": "snap",
                "lease_id": 9,
                "replay": [],
            },
            "replay": replay,
        }
    )

    with sync_client(server) as client:
        result = client.lookup("t", [], call("get", key="a"), epoch=0)

    assert result == LookupResult(
        hit=False,
        matched=2,
        resume=Resume(node_id=3, snapshot_id=4, snapshot_ref="snap", lease_id=9, replay=()),
        replay=tuple(replay),
    )
    assert json.loads(server.requests[0].content) == {
        "history": [],
        "call": call("get", key="a"),
        "epoch": 0,
    }


def test_record_answer_says_whether_a_snapshot_is_wanted():
    server = Server(body={"node_id": 5, "created": False, "snapshot": "wanted", "evicted": ["x"]})

    with sync_client(server) as client:
        recorded = client.record("t", [], call("list"), {"keys": []}, 1.5, rollout_id="r")

    assert recorded.snapshot_wanted and recorded.evicted == ("x",) and recorded.node_id == 5


def test_release_lease_sends_restore_time_only_when_given():
    server = Server(204)

    with sync_client(server) as client:
        assert client.release_lease(9, restore_ms=12.5) is None
        client.release_lease(10)

    first, second = server.requests
    assert (first.method, first.url.path, first.url.params["restore_ms"]) == (
        "DELETE",
        "/api/v1/leases/9",
        "12.5",
    )
    assert second.url.query == b""


def test_list_tasks_returns_the_task_list():
    server = Server(body={"tasks": [{"task_id": "t"}]})

    with sync_client(server) as client:
        assert client.list_tasks() == [{"task_id": "t"}]


def paged_tasks(seen: list[dict[str, str]]):
    """A task list of two pages, one task each."""

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(dict(request.url.params))
        offset = int(request.url.params.get("offset", 0))
        return httpx.Response(
            200, json={"tasks": [{"id": f"t{offset}"}], "count": 2, "next_offset": 1 if offset == 0 else None}
        )

    return answer


def test_list_tasks_follows_the_pages_sync_and_async():
    seen: list[dict[str, str]] = []
    with served(paged_tasks(seen)) as url, TVCacheClient(url, "secret") as client:
        assert client.list_tasks(search="t") == [{"id": "t0"}, {"id": "t1"}]
    assert seen == [{"q": "t"}, {"q": "t", "offset": "1"}]

    async def listed():
        async with AsyncTVCacheClient(BASE, "secret", transport=httpx.MockTransport(paged_tasks(seen))) as client:
            return await client.list_tasks()

    assert asyncio.run(listed()) == [{"id": "t0"}, {"id": "t1"}]
    assert seen[2:] == [{}, {"offset": "1"}]


def test_error_answer_becomes_tvcache_error():
    details = {"history": ["required"]}
    server = Server(400, {"error": {"code": "invalid", "message": "bad call", "details": details}})

    with sync_client(server) as client, pytest.raises(TVCacheError) as raised:
        client.lookup("t", [], call("get"))

    error = raised.value
    assert (error.status, error.code, error.message, error.details) == (
        400,
        "invalid",
        "bad call",
        details,
    )
    assert not isinstance(error, TVCacheUnavailable)


def test_gateway_page_becomes_unavailable():
    server = Server(502, content=b"<html>Bad Gateway</html>")

    with sync_client(server) as client, pytest.raises(TVCacheUnavailable) as raised:
        client.stats("t")

    assert (raised.value.status, raised.value.code) == (502, "http_502")


def test_unreachable_service_is_unavailable():
    with served(Server()) as url:
        pass  # the port is closed again: connections to it are refused

    with TVCacheClient(url, "secret") as client:
        with pytest.raises(TVCacheUnavailable) as raised:
            client.pools()

    assert (raised.value.status, raised.value.code) == (None, "unavailable")


def test_answer_missing_contract_fields_is_a_bad_response():
    server = Server(body={"hit": True})

    with sync_client(server) as client, pytest.raises(TVCacheError) as raised:
        client.lookup("t", [], call("get"))

    assert (raised.value.status, raised.value.code) == (200, "bad_response")


def test_async_client_shares_the_contract():
    hit = {"hit": True, "node_id": 1, "result": {"value": "v"}}
    error = {"error": {"code": "not_found", "message": "no task", "details": None}}
    servers = [Server(body=hit), Server(404, error)]

    async def ask(server):
        transport = httpx.MockTransport(server)
        async with AsyncTVCacheClient(BASE, "secret", transport=transport) as client:
            return await client.lookup("t", [], call("get", key="a"), rollout_id="r")

    assert asyncio.run(ask(servers[0])) == LookupResult(hit=True, node_id=1, result={"value": "v"})
    assert servers[0].requests[0].headers["Authorization"] == "Token secret"
    with pytest.raises(TVCacheError) as raised:
        asyncio.run(ask(servers[1]))
    assert (raised.value.status, raised.value.code) == (404, "not_found")


def test_connections_of_finished_threads_are_closed():
    server = Server(body={"tasks": []})
    with sync_client(server) as client:
        threads = [threading.Thread(target=client.list_tasks) for _ in range(20)]
        for thread in threads:
            thread.start()
            thread.join()
        gc.collect()
        assert len(server.requests) == 20
        assert len(client._http._all) == 0  # one connection per thread, gone with it
        client.list_tasks()  # the calling thread's own connection stays
        assert len(client._http._all) == 1


def test_a_lookup_carries_the_services_own_time():
    class Timed(Server):
        def __call__(self, request):
            response = super().__call__(request)
            response.headers["Server-Timing"] = "queue;dur=0.25, app;dur=1.5, total;dur=2.125"
            return response

    hit = {"hit": True, "node_id": 1, "result": {"value": "v"}}
    with sync_client(Timed(body=hit)) as client:
        assert client.lookup("t", [], call("get", key="a")).server_ms == 2.125
    with sync_client(Server(body=hit)) as client:  # a server (or proxy) that does not say
        assert client.lookup("t", [], call("get", key="a")).server_ms is None

    async def ask():
        async with AsyncTVCacheClient(BASE, "secret", transport=httpx.MockTransport(Timed(body=hit))) as client:
            return await client.lookup("t", [], call("get", key="a"))

    assert asyncio.run(ask()).server_ms == 2.125


@pytest.mark.parametrize(
    "header, expected",
    [
        ("total;dur=3", 3.0),
        ('app;dur=1, total;desc="all";dur=4.5', 4.5),
        ("app;dur=1", None),
        ("total;dur=x", None),
        ("", None),
        (None, None),
        ("total", None),
    ],
)
def test_server_timing_header_is_read_leniently(header, expected):
    assert server_ms(header) == expected
