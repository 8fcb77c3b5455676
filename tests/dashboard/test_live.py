"""Live updates over the Redis channel layer: the ledger coalesces, the consumer forwards,
anonymous and cross-site sockets are refused, and a Redis outage never reaches the caller."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.db import transaction
from django.test import Client

from cache import ledger
from tvcache_site.asgi import application

# A prefix of the run's own: another tvcache on the same Redis (a replay, a demo) sends its events too.
REDIS_LAYER = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": ["redis://127.0.0.1:6379/0"], "prefix": f"test-{uuid.uuid4().hex}"},
    }
}


@pytest.fixture
def redis_layer(settings):
    settings.CHANNEL_LAYERS = REDIS_LAYER
    ledger._ledger.paused_until = 0.0
    yield
    ledger._ledger.paused_until = 0.0


def lookup(
    task_id: str,
    hit: bool,
    *,
    seen: bool | None = None,
    epoch: int = 0,
    tool: str = "",
    node_id: int | None = None,
    saved_ms: float = 0.0,
) -> None:
    """A lookup answered, as the lookup service counts it (`seen`: the oracle's hit; `hit` unless said)."""
    ledger.lookup_add(
        task_id=task_id,
        epoch=epoch,
        tool=tool,
        rollout_id="",
        node_id=node_id,
        hit=hit,
        seen=hit if seen is None else seen,
        saved_ms=saved_ms,
    )


@pytest.fixture
def task_id() -> str:
    return "live-" + uuid.uuid4().hex[:10]  # no leftovers of another test on this group


def session_headers(user, origin: bytes = b"http://127.0.0.1") -> list[tuple[bytes, bytes]]:
    client = Client()
    client.force_login(user)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    return [(b"cookie", cookie), (b"origin", origin), (b"host", b"127.0.0.1")]


async def receive_json(communicator, timeout: float = 3.0) -> dict:
    return json.loads(await communicator.receive_from(timeout=timeout))


@pytest.mark.django_db(transaction=True)
def test_a_thousand_lookups_arrive_as_a_few_summaries(redis_layer, staff_user, task_id):
    headers = session_headers(staff_user)

    async def scenario():
        task_socket = WebsocketCommunicator(application, f"/ws/dashboard/tasks/{task_id}/", headers=headers)
        overview = WebsocketCommunicator(application, "/ws/dashboard/overview/", headers=headers)
        assert (await task_socket.connect())[0] and (await overview.connect())[0]
        for i in range(1000):
            # 3 in 4 hit; every other miss had been seen (e.g. a tool that is not cacheable): the oracle's hit.
            lookup(task_id, i % 4 != 0, seen=i % 8 != 0, epoch=2, tool="bash", node_id=7, saved_ms=10.0)
        ledger.node_created(task_id, 99)
        ledger.flush_now()
        totals = {"lookups": 0, "hits": 0, "oracle": 0, "saved_ms": 0.0, "messages": 0, "events": []}
        while totals["lookups"] < 1000:
            message = await receive_json(task_socket)
            assert message["type"] == "task" and message["task_id"] == task_id
            totals["lookups"] += message["lookups"]
            totals["hits"] += message["hits"]
            totals["oracle"] += message["oracle"]
            totals["saved_ms"] += message["saved_ms"]
            totals["messages"] += 1
            totals["events"] += message["events"]
        assert (totals["hits"], totals["oracle"], totals["saved_ms"]) == (750, 875, 7500.0)
        assert totals["messages"] <= 2
        assert {"kind": "node_created", "node_id": 99} in totals["events"]
        seen = 0
        while seen < 1000:
            message = await receive_json(overview)
            if task_id in message["tasks"]:
                seen += message["tasks"][task_id]["lookups"]
                assert message["tasks"][task_id]["per_epoch"]["2"][0] <= 1000
        await task_socket.disconnect()
        await overview.disconnect()

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_the_page_and_the_stats_count_the_same_lookups(redis_layer, staff_user, task_id, api):
    """One ledger: the lookups a stats read writes to PostgreSQL reach the page too, counted once."""
    write = {"tool": "write", "args": {"path": "f"}}
    assert api.put(f"/api/v1/tasks/{task_id}", {"env": {"backend": "external"}}, format="json").status_code == 201
    headers = session_headers(staff_user)

    async def scenario():
        socket = WebsocketCommunicator(application, f"/ws/dashboard/tasks/{task_id}/", headers=headers)
        assert (await socket.connect())[0]
        answers = [
            await asyncio.to_thread(api.post, f"/api/v1/tasks/{task_id}/{path}", body, format="json")
            for path, body in [
                ("lookup", {"history": [], "call": write}),
                ("record", {"history": [], "call": write, "result": {"ok": 1}, "exec_ms": 5.0}),
                *[("lookup", {"history": [], "call": write})] * 3,
            ]
        ]
        assert [a.status_code for a in answers] == [200] * 5
        stats = (await asyncio.to_thread(api.get, f"/api/v1/tasks/{task_id}/stats")).json()  # writes them first
        ledger.flush_now()
        lookups, hits = 0, 0
        while lookups < 4:
            message = await receive_json(socket)
            lookups, hits = lookups + message["lookups"], hits + message["hits"]
        assert (lookups, hits) == (stats["calls"], stats["hits"]) == (4, 3)
        assert await socket.receive_nothing(timeout=0.7)  # each delta once
        await socket.disconnect()

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_a_steady_flood_is_coalesced_to_a_few_messages_per_second(redis_layer, staff_user, task_id):
    headers = session_headers(staff_user)
    done = threading.Event()

    def flood():  # about 1,000 lookups per second for 1.5 s
        for _ in range(1500):
            lookup(task_id, True, tool="bash")
            time.sleep(0.001)
        done.set()

    async def scenario():
        socket = WebsocketCommunicator(application, f"/ws/dashboard/tasks/{task_id}/", headers=headers)
        assert (await socket.connect())[0]
        thread = threading.Thread(target=flood)
        thread.start()
        messages, lookups = 0, 0
        while lookups < 1500:
            message = await receive_json(socket)
            messages += 1
            lookups += message["lookups"]
        thread.join()
        # Flushes are FLUSH_INTERVAL_S apart: 1,500 lookups over ~1.6 s arrive in ~6 messages. The bound
        # leaves room for a slow machine and still means 100 lookups or more per message.
        assert lookups == 1500
        assert messages <= 15
        await socket.disconnect()

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_anonymous_and_cross_site_sockets_are_refused(redis_layer, staff_user):
    foreign_headers = session_headers(staff_user, origin=b"http://evil.example")

    async def scenario():
        anonymous = WebsocketCommunicator(
            application, "/ws/dashboard/overview/", headers=[(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")]
        )
        assert (await anonymous.connect())[0] is False
        foreign = WebsocketCommunicator(application, "/ws/dashboard/overview/", headers=foreign_headers)
        assert (await foreign.connect())[0] is False

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_events_of_a_rolled_back_change_are_never_sent(redis_layer, staff_user, task_id):
    headers = session_headers(staff_user)

    async def scenario():
        socket = WebsocketCommunicator(application, f"/ws/dashboard/tasks/{task_id}/", headers=headers)
        assert (await socket.connect())[0]

        def change(fail: bool, ref: str):
            try:
                with transaction.atomic():
                    ledger.snapshot_event(task_id, "evicted", node_id=1, ref=ref)
                    if fail:
                        raise RuntimeError("rolled back")
            except RuntimeError:
                pass

        await asyncio.to_thread(change, True, "lost")
        await asyncio.to_thread(change, False, "kept")
        ledger.flush_now()
        message = await receive_json(socket)
        assert [e["ref"] for e in message["events"]] == ["kept"] and message["snapshots"] == -1
        await socket.disconnect()

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_redis_down_never_reaches_the_caller_and_recovery_is_automatic(settings, staff_user, task_id, monkeypatch):
    monkeypatch.setattr(ledger, "BACKOFF_S", 0.5)
    settings.CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": ["redis://127.0.0.1:9/0"]}}
    }  # nothing listens
    ledger._ledger.paused_until = 0.0
    for _ in range(100):
        lookup(task_id, True)  # must not raise
    ledger.flush_now()
    deadline = time.monotonic() + 5
    while ledger._ledger.paused_until == 0.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ledger._ledger.paused_until > 0.0  # the failed flush was absorbed by the thread
    settings.CHANNEL_LAYERS = REDIS_LAYER
    time.sleep(0.6)  # past the back-off
    headers = session_headers(staff_user)

    async def scenario():
        socket = WebsocketCommunicator(application, f"/ws/dashboard/tasks/{task_id}/", headers=headers)
        assert (await socket.connect())[0]
        lookup(task_id, False)
        ledger.flush_now()
        message = await receive_json(socket)
        assert message["lookups"] == 1 and message["hits"] == 0  # the outage's counts were dropped, not queued
        await socket.disconnect()

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_pool_and_snapshot_events_reach_the_pools_page(redis_layer, staff_user, task_id):
    headers = session_headers(staff_user)

    async def scenario():
        pools = WebsocketCommunicator(application, "/ws/dashboard/pools/", headers=headers)
        overview = WebsocketCommunicator(application, "/ws/dashboard/overview/", headers=headers)
        assert (await pools.connect())[0] and (await overview.connect())[0]
        await asyncio.to_thread(ledger.pool_changed, task_id=task_id, pool="docker", state="ready")
        await asyncio.to_thread(ledger.snapshot_event, task_id, "created", node_id=3, ref="img:3")
        await asyncio.to_thread(ledger.task_changed, task_id, "flushed")
        ledger.flush_now()
        events = []
        while len(events) < 2:
            message = await receive_json(pools)
            assert message["type"] == "pools"
            events += message["events"]
        assert {"kind": "pool", "task_id": task_id, "pool": "docker", "state": "ready"} in events
        assert any(e["kind"] == "snapshot" and e["ref"] == "img:3" for e in events)
        while True:  # the overview refetches its table for a structural change
            message = await receive_json(overview)
            if task_id in message["tasks"]:
                break
        assert message["changed"] == [task_id] and message["tasks"][task_id]["snapshots"] == 1
        await pools.disconnect()
        await overview.disconnect()

    async_to_sync(scenario)()
