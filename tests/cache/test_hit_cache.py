"""The process's cache of hit answers (cache/services/hitcache.py): a hit served again costs no
statement and answers the same bytes, is counted and sampled like any hit, stays in its project,
and is never served once a change that made it unservable has answered, whichever process made
the change and whichever serves the lookup."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.conf import settings
from django.db import connection

from accounts.services.tokens import token_create
from cache.models import Divergence, Node
from cache.services import divergence_record
from cache.services.hitcache import (
    CachedHit,
    HitCache,
    hit_cache,
    version_move_wait_s,
)
from lab.server import service_running
from tests.support.api import call, lookup, project_clients, record

W = call("write", path="f", content="1")
W2 = call("write", path="g", content="2")
R = call("read", path="f")
EXTERNAL = {"env": {"backend": "external", "name": "hits"}, "tools": {"read": {"mutates_state": False}}}


def lookup_raw(api, task: str, history: list, c: dict, **extra):
    response = api.post(f"/api/v1/tasks/{task}/lookup", {"history": history, "call": c, **extra}, format="json")
    assert response.status_code == 200, response.content
    return response.content


def statements(api, task: str, history: list, c: dict, **extra) -> tuple[bytes, list[str]]:
    """A lookup's answer and the SQL of the statements it ran."""
    sent = []

    def kept(execute, sql, params, many, context):
        sent.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(kept):
        content = lookup_raw(api, task, history, c, **extra)
    return content, sent


@pytest.mark.django_db
def test_a_hit_is_served_again_without_a_statement_and_answers_the_same_bytes(api, hit_cache_window):
    hit_cache_window()
    assert api.put("/api/v1/tasks/cached", EXTERNAL, format="json").status_code == 201
    node = record(api, "cached", [], W, {"ok": True, "text": 'é \u2028 "quoted"'})["node_id"]
    record(api, "cached", [W], R, {"output": "1"})
    first, read = statements(api, "cached", [W], R)  # the database's answer
    assert len(read) == 1 and "cache_node" in read[0]
    again, none = statements(api, "cached", [W], R)
    assert none == [] and again == first
    writes, none = statements(api, "cached", [], W, rollout_id="r1", epoch=2)
    writes_again, none_again = statements(api, "cached", [], W, rollout_id="r1", epoch=2)
    assert len(none) == 1 and none_again == [] and writes_again == writes
    assert lookup(api, "cached", [], W) == {
        "hit": True,
        "node_id": node,
        "mutates": True,
        "result": {"ok": True, "text": 'é \u2028 "quoted"'},
    }
    # Counted as hits, the node's too (the ledger, flushed when stats are read).
    stats = api.get("/api/v1/tasks/cached/stats").json()
    assert (stats["calls"], stats["hits"]) == (5, 5)
    assert Node.objects.get(pk=node).hit_count == 3


@pytest.mark.django_db
def test_a_lapsed_lease_is_renewed_by_reading_the_tasks_version_alone(api, hit_cache_window):
    hit_cache_window(ms=30)
    api.put("/api/v1/tasks/lapsed", EXTERNAL, format="json")
    record(api, "lapsed", [], W, {"ok": True})
    first = lookup_raw(api, "lapsed", [], W)
    time.sleep(0.1)
    again, read = statements(api, "lapsed", [], W)
    assert again == first
    assert len(read) == 1 and "cache_node" not in read[0] and "version" in read[0]


@pytest.mark.django_db
def test_a_sampled_cached_hit_says_audit(api, hit_cache_window):
    hit_cache_window()
    api.put("/api/v1/tasks/sampled", {**EXTERNAL, "audit_rate": 1.0}, format="json")
    node = record(api, "sampled", [], W, {"ok": True})["node_id"]
    assert lookup(api, "sampled", [], W)["audit"] is True
    content, read = statements(api, "sampled", [], W)
    assert read == []
    assert content == b'{"hit":true,"node_id":%d,"mutates":true,"audit":true,"result":{"ok":true}}' % node


@pytest.mark.django_db
def test_each_project_is_served_its_own_tasks_hits(hit_cache_window):
    hit_cache_window()
    clients = project_clients(roles=("trainer",))
    alpha, beta = clients["alpha", "trainer"], clients["beta", "trainer"]
    for name, client in (("alpha", alpha), ("beta", beta)):
        assert client.put("/api/v1/tasks/same", EXTERNAL, format="json").status_code == 201
        record(client, "same", [], W, {"ok": name})
    for _ in range(2):  # the second round from the cache
        assert lookup(alpha, "same", [], W)["result"] == {"ok": "alpha"}
        assert lookup(beta, "same", [], W)["result"] == {"ok": "beta"}
    assert len(hit_cache()) == 2


@pytest.mark.django_db
@pytest.mark.parametrize("change", ["env", "tools", "flush", "audit_read", "audit_write", "evict"])
def test_a_change_in_this_process_is_seen_by_its_next_lookup(api, hit_cache_window, change):
    """Within the window, by this process: a change drops the process's lease on the task."""
    hit_cache_window()
    api.put("/api/v1/tasks/moved", EXTERNAL, format="json")
    written = record(api, "moved", [], W, {"ok": True})["node_id"]
    read = record(api, "moved", [W], R, {"output": "1"})["node_id"]
    for _ in range(2):
        assert lookup(api, "moved", [W], R)["hit"] is True
    if change == "env":
        assert (
            api.put(
                "/api/v1/tasks/moved", {**EXTERNAL, "env": {"backend": "external", "name": "other"}}, format="json"
            ).status_code
            == 200
        )
    elif change == "tools":
        assert api.put("/api/v1/tasks/moved", {**EXTERNAL, "tools": {}}, format="json").status_code == 200
    elif change == "flush":
        assert api.post("/api/v1/tasks/moved/flush").status_code == 200
    elif change == "evict":
        assert (
            api.post(f"/api/v1/tasks/moved/nodes/{written}/evict", {"subtree": True}, format="json").status_code == 200
        )
    else:  # a read-only node, or the write above it (a divergent state: nothing below is served)
        node = read if change == "audit_read" else written
        answer = api.post(f"/api/v1/tasks/moved/nodes/{node}/audit", {"result": {"other": 1}}, format="json")
        assert answer.json() == {"divergent": True}
    assert lookup(api, "moved", [W], R)["hit"] is False


@pytest.mark.django_db
def test_the_cache_holds_at_most_its_entries_least_recently_served_out_first(api, hit_cache_window):
    cache = hit_cache_window(entries=2)
    api.put("/api/v1/tasks/small", EXTERNAL, format="json")
    for c in (W, W2, R):
        record(api, "small", [], c, {"c": c["args"]})
    for c in (W, W2):
        lookup(api, "small", [], c)
    assert statements(api, "small", [], W)[1] == []  # W is now the most recently served
    lookup(api, "small", [], R)  # from the database: W2 goes out
    assert len(cache) == 2
    assert statements(api, "small", [], W)[1] == [] and statements(api, "small", [], R)[1] == []
    content, read = statements(api, "small", [], W2)
    assert len(read) == 1 and b'"hit":true' in content


def test_the_cache_holds_at_most_its_bytes():
    cache = HitCache(entries=100, max_bytes=25, window_s=1.0)
    stamp = (1, None)
    for index in range(4):
        cache.put(("t", "a", str(index)), stamp, CachedHit(index, "x" * 10, 1.0, True))
    assert len(cache) == 2 and cache.get(("t", "a", "0"), stamp) is None and cache.get(("t", "a", "3"), stamp)
    cache.put(("t", "a", "big"), stamp, CachedHit(9, "x" * 26, 1.0, True))  # larger than the whole cache
    assert len(cache) == 2 and cache.get(("t", "a", "big"), stamp) is None
    assert cache.get(("t", "a", "3"), (2, None)) is None  # another version's entry is not served


@pytest.mark.django_db
def test_zero_entries_turn_it_off(api, hit_cache_window):
    hit_cache_window(entries=0)
    assert version_move_wait_s() == 0.0
    api.put("/api/v1/tasks/off", EXTERNAL, format="json")
    record(api, "off", [], W, {"ok": True})
    for _ in range(3):
        content, read = statements(api, "off", [], W)
        assert len(read) == 1 and "cache_node" in read[0] and b'"hit":true' in content
    assert len(hit_cache()) == 0


@pytest.mark.django_db(transaction=True)
def test_a_version_move_answers_after_the_window(api):
    """The default window: a committed change that moves the version answers no sooner."""
    window = settings.TVCACHE["HIT_CACHE_WINDOW_MS"] / 1000
    assert window > 0 and version_move_wait_s() > window
    api.put("/api/v1/tasks/slow", EXTERNAL, format="json")
    started = time.monotonic()
    assert api.post("/api/v1/tasks/slow/flush").status_code == 200
    assert time.monotonic() - started >= window


class Hammer:
    """Threads sending the same lookups over connections of their own (new ones now and then, so
    that both server processes serve them), each answer kept with the time it was sent."""

    def __init__(self, url: str, token: str, task: str, lookups: list[tuple[list, dict]], threads: int = 6):
        self.url, self.headers, self.path = url, {"Authorization": f"Token {token}"}, f"/api/v1/tasks/{task}/lookup"
        self.lookups, self.stop, self.answers = lookups, threading.Event(), []
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(threads)
        self.futures = [self.pool.submit(self._run, index) for index in range(threads)]

    def _run(self, index: int) -> None:
        sent = 0
        while not self.stop.is_set():
            with httpx.Client(base_url=self.url, headers=self.headers, timeout=30) as client:
                for _ in range(20):
                    history, c = self.lookups[(index + sent) % len(self.lookups)]
                    at = time.monotonic()
                    answer = client.post(self.path, json={"history": history, "call": c})
                    assert answer.status_code == 200, answer.text
                    with self.lock:
                        self.answers.append((at, history, c, answer.json()))
                    sent += 1

    def until(self, predicate, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, "the hammer did not get there"
            time.sleep(0.01)

    def sent_after(self, moment: float) -> list[tuple[float, list, dict, dict]]:
        with self.lock:
            return [answer for answer in self.answers if answer[0] > moment]

    def close(self) -> None:
        self.stop.set()
        for future in self.futures:
            future.result()
        self.pool.shutdown()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_no_process_serves_a_hit_that_a_change_answered_before_made_unservable():
    """Two server processes serve a stream of hits from their caches (the default window) while
    another process (the test, or one of the servers for the other) makes a change; every lookup
    sent after the change answered must not be that hit. Each kind of change, several times."""
    token = token_create(name="hits")
    changes = ["audit_read", "audit_write", "divergence_here", "env", "flush", "evict"]
    with (
        service_running(db=settings.DATABASES["default"], redis_url=settings.REDIS_URL, workers=2) as service,
        httpx.Client(base_url=service.url, headers={"Authorization": f"Token {token}"}, timeout=30) as client,
    ):
        for round_ in range(3):
            for change in changes:
                task = f"race-{change.replace('_', '-')}-{round_}"
                assert client.put(f"/api/v1/tasks/{task}", json=EXTERNAL).status_code == 201
                base = f"/api/v1/tasks/{task}"
                written = client.post(
                    f"{base}/record", json={"history": [], "call": W, "result": {"w": task}, "exec_ms": 5.0}
                ).json()["node_id"]
                read = client.post(
                    f"{base}/record", json={"history": [W], "call": R, "result": {"r": task}, "exec_ms": 5.0}
                ).json()["node_id"]
                hammer = Hammer(service.url, token, task, [([W], R), ([], W)])
                try:
                    hammer.until(lambda h=hammer: len(h.answers) > 200)
                    assert all(answer["hit"] for *_, answer in hammer.answers)
                    made = _change(client, base, task, change, written, read)
                    answered = time.monotonic()
                    hammer.until(lambda h=hammer, t=answered: len(h.sent_after(t)) > 100)
                finally:
                    hammer.close()
                # A divergent read-only node alone; a divergent write with what lies below it; or both.
                unservable = [R] if change in ("audit_read", "divergence_here") else [R, W]
                after = [(c, answer) for _, _, c, answer in hammer.sent_after(answered) if c in unservable]
                stale = [(c, answer) for c, answer in after if answer["hit"]]
                assert stale == [], (made, stale[:3])
                assert len(after) > 20


def _change(client: httpx.Client, base: str, task: str, change: str, written: int, read: int) -> str:
    """Make `change` to the task; returns once it has answered."""
    if change == "env":
        response = client.put(base, json={**EXTERNAL, "env": {"backend": "external", "name": "moved"}})
    elif change == "flush":
        response = client.post(f"{base}/flush")
    elif change == "evict":
        response = client.post(f"{base}/nodes/{written}/evict", json={"subtree": True})
    elif change == "divergence_here":  # in this process, through the service
        divergence_record(
            task_id=task,
            node_id=read,
            tool="read",
            kind=Divergence.Kind.AUDIT,
            expected={"r": task},
            observed={"r": "other"},
        )
        return change
    else:
        node = read if change == "audit_read" else written
        response = client.post(f"{base}/nodes/{node}/audit", json={"result": {"other": 1}})
    assert response.status_code == 200, response.text
    return change
