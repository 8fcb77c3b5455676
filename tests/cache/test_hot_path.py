"""The deployed application answers lookup and record before Django's handler and middleware
(cache/api/frontdoor.py: FrontDoorASGI): every answer must be the one Django gives, byte for byte,
headers included, and whatever the hot path is unsure of must still reach Django."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from django.db import connections
from django.test import override_settings

from accounts.models import Project
from accounts.projects import DEFAULT_PROJECT
from accounts.services import tokens
from cache.api.frontdoor import FrontDoor, FrontDoorASGI
from cache.api.views import LookupView, RecordView
from cache.tcg import match
from sandboxes.api import RolloutCallView
from tests.support.api import call
from tvcache_site import asgi as asgi_module

# Transactions: the hot path checks the connection like request_started does (and under ASGI
# answers on threads of its own), and a connection inside a test's atomic block looks obsolete.
pytestmark = pytest.mark.django_db(transaction=True)

W = call("write", path="f", content="1")
R = call("read", path="f")


def asgi(
    app,
    method: str,
    path: str,
    body: bytes = b"",
    token: str | None = None,
    host: str = "127.0.0.1:8000",
    content_length: bool = True,
    request_id: str | None = "test-request-1",
):
    headers = [(b"host", host.encode()), (b"content-type", b"application/json")]
    if content_length:
        headers.append((b"content-length", str(len(body)).encode()))
    if token is not None:
        headers.append((b"authorization", token.encode()))
    if request_id is not None:
        headers.append((b"x-request-id", request_id.encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    sent = []

    async def run():
        incoming = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if incoming:
                return incoming.pop()
            await asyncio.Event().wait()  # the client stays connected

        async def send(message):
            sent.append(message)

        await app(scope, receive, send)

    asyncio.run(run())
    start = sent[0]
    content = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], sorted((k.decode().lower(), v.decode()) for k, v in start["headers"]), content


def test_the_deployed_application_takes_the_hot_routes():
    fast = asgi_module.http_application
    assert [view for _, view in fast.hot.routes] == [LookupView, RecordView, RolloutCallView]
    assert fast.hot.enabled


@pytest.fixture
def door():
    """(send, hot-path application, Django's application, make(views) -> hot-path application)."""
    made = []

    def make(views):
        made.append(FrontDoorASGI(asgi_module.django_asgi, views, threads={"read": 1, "write": 1, "tool": 1}))
        return made[-1]

    yield asgi, make([LookupView, RecordView, RolloutCallView]), asgi_module.django_asgi, make
    for app in made:  # the answering threads' connections, or the test database cannot be dropped
        for executor in app.executors.values():
            executor.submit(connections.close_all).result()
            executor.shutdown()


@pytest.fixture
def auth(token) -> str:
    return f"Token {token}"


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_answers_equal_djangos(door, toy_task, auth):
    send, fast, plain, _ = door

    def both(method, path, content=b"", **kwargs):
        status, headers, answer = send(fast, method, path, content, **kwargs)
        if path.endswith(("/lookup", "/record", "/calls")) and method == "POST" and "host" not in kwargs:
            timing = [v for k, v in headers if k == "server-timing"]  # the hot path's own header
            assert len(timing) == 1 and re.fullmatch(
                r"queue;dur=[\d.]+, app;dur=[\d.]+, db;dur=[\d.]+, total;dur=[\d.]+", timing[0]
            )
            headers = [(k, v) for k, v in headers if k != "server-timing"]
        if ("connection", "close") in headers:  # the door refused the body unread, and closes
            assert status == 401 and content
            headers.remove(("connection", "close"))
        assert (status, headers, answer) == send(plain, method, path, content, **kwargs)
        return status, headers, answer

    task = f"/api/v1/tasks/{toy_task}"
    for history, c, result in (([], W, {"ok": True}), ([W], R, {"output": "1"})):
        first = send(
            fast, "POST", f"{task}/record", body(history=history, call=c, result=result, exec_ms=1.0), token=auth
        )
        assert json.loads(first[2])["created"] is True
        again = both("POST", f"{task}/record", body(history=history, call=c, result=result, exec_ms=1.0), token=auth)
        assert json.loads(again[2])["node_id"] == json.loads(first[2])["node_id"]  # idempotent, like Django's answer
    status, _, content = both("POST", f"{task}/lookup", body(history=[W], call=R, rollout_id="r"), token=auth)
    assert status == 200 and json.loads(content)["hit"] is True
    status, _, content = both("POST", f"{task}/lookup", body(history=[W, W], call=R), token=auth)
    assert json.loads(content)["hit"] is False and json.loads(content)["matched"] == 1
    for kwargs in ({}, {"token": "Token nope"}, {"token": "Bearer x"}, {"token": f"{auth} extra"}):
        status, headers, _ = both("POST", f"{task}/lookup", body(history=[], call=R), **kwargs)
        assert status == 401 and ("www-authenticate", "Token") in headers
    assert both("POST", f"{task}/lookup", b"{not json", token=auth)[0] == 400
    assert both("POST", f"{task}/lookup", body(history="x", call=R), token=auth)[0] == 400
    assert both("POST", f"{task}/record", body(history=[], call=R, result=1, exec_ms=-1), token=auth)[0] == 400
    assert both("POST", "/api/v1/tasks/nope/lookup", body(history=[], call=R), token=auth)[0] == 404
    assert both("POST", f"{task}/lookup", body(history=[], call=R, env_fingerprint="0" * 64), token=auth)[0] == 409
    calls = f"{task}/rollouts/r1/calls"  # tool-server mode; an external task is not served
    assert json.loads(both("POST", calls, body(call=R), token=auth)[2])["error"]["code"] == "not_managed"
    assert json.loads(both("POST", calls, body(), token=auth)[2])["error"]["code"] == "missing_field"
    # What the hot path is unsure of reaches Django.
    assert both("GET", f"{task}/lookup", token=auth)[0] == 405
    assert both("POST", f"{task}/lookup", body(history=[], call=R), token=auth, host="evil.example")[0] == 400
    assert both("POST", f"{task}/lookup/", body(history=[], call=R), token=auth)[0] == 404


def test_the_hot_path_echoes_the_request_id_or_makes_one(door, toy_task, auth):
    send, fast, _, _ = door
    lookup = f"/api/v1/tasks/{toy_task}/lookup"
    for incoming, echoed in (("trace-7f3a:1", "trace-7f3a:1"), (None, None), ("has space", None), ("x" * 129, None)):
        status, headers, _ = send(fast, "POST", lookup, body(history=[], call=R), token=auth, request_id=incoming)
        ids = [v for k, v in headers if k == "x-request-id"]
        assert status == 200 and len(ids) == 1
        assert ids[0] == echoed if echoed else re.fullmatch(r"[0-9a-f]{32}", ids[0])  # a sane one is made


def test_a_chunked_body_reaches_django(door, toy_task, auth):
    send, fast, plain, _ = door
    lookup = f"/api/v1/tasks/{toy_task}/lookup"
    answer = send(fast, "POST", lookup, body(history=[], call=R), token=auth, content_length=False)
    assert "server-timing" not in dict(answer[1])  # Django answered it
    assert answer == send(plain, "POST", lookup, body(history=[], call=R), token=auth, content_length=False)


def test_body_over_the_upload_limit_is_413_like_django(door, toy_task, auth):
    send, _, plain, make = door
    big = body(history=[call("write", path="f", content="x" * 2000)], call=R)
    with override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000):
        fast = make([LookupView])
        status, _, content = send(fast, "POST", f"/api/v1/tasks/{toy_task}/lookup", big, token=auth)
        assert (status, content) == send(plain, "POST", f"/api/v1/tasks/{toy_task}/lookup", big, token=auth)[::2]
    assert status == 413 and json.loads(content)["error"]["code"] == "payload_too_large"


def test_a_route_that_moved_is_left_to_django(door):
    class Moved(LookupView):
        route = "/api/v1/tasks/{task_id}/lookup"

    assert door[3]([Moved]).hot.routes == []


def in_thread(path: str, content: bytes, token: str) -> tuple[int, bytes]:
    """What the front door's lane thread does for a request, done on this thread: its statements
    count in django_assert_num_queries."""
    hot = FrontDoor([LookupView, RecordView, RolloutCallView])
    path_kwargs, view = hot.route("POST", path, "http", "127.0.0.1:8000", str(len(content)))
    answer = hot.respond(
        view,
        path_kwargs=path_kwargs,
        authorization=token,
        read_body=lambda: content,
        request=lambda: None,
        incoming_id=None,
    )
    return answer.status, answer.body


def test_a_hit_is_one_query_on_the_hot_path(toy_task, auth, django_assert_num_queries):
    task = f"/api/v1/tasks/{toy_task}"
    in_thread(f"{task}/record", body(history=[], call=W, result={"ok": True}, exec_ms=5.0), auth)
    in_thread(f"{task}/lookup", body(history=[], call=W), auth)  # task handle cached
    with django_assert_num_queries(1):
        status, content = in_thread(f"{task}/lookup", body(history=[], call=W), auth)
    assert status == 200 and json.loads(content)["hit"] is True


def test_an_unexpected_error_is_djangos_json_500(door, toy_task, auth, monkeypatch):
    send, fast, _, _ = door

    def broken(**kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(LookupView, "answer", staticmethod(broken))
    status, headers, content = send(
        fast, "POST", f"/api/v1/tasks/{toy_task}/lookup", body(history=[], call=R), token=auth
    )
    assert status == 500
    assert json.loads(content)["error"]["code"] == "internal_error"
    assert ("x-content-type-options", "nosniff") in headers


@pytest.mark.parametrize("authorization", [None, "Token wrong", "Bearer x"])
def test_a_request_without_a_valid_token_is_refused_before_its_body_is_read(door, toy_task, authorization):
    fast = door[1]
    path = f"/api/v1/tasks/{toy_task}/lookup"
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"content-length", str(2 * 1024 * 1024).encode()),
            *([(b"authorization", authorization.encode())] if authorization else []),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    sent = []

    async def receive():
        raise AssertionError("the body was read")

    async def collect(message):
        sent.append(message)

    asyncio.run(asyncio.wait_for(fast(scope, receive, collect), 30))
    status, body = sent[0]["status"], sent[1]["body"]
    assert status == 401
    assert json.loads(body)["error"]["code"] == (
        "invalid_token" if authorization == "Token wrong" else "not_authenticated"
    )


def test_a_hit_the_process_holds_is_answered_on_the_event_loop(door, toy_task, auth, api, hit_cache_window):
    """A hit the process's hit cache holds under a lease needs no lane thread: the event loop
    answers it, with the bytes the lane gave, counted like any hit."""
    send, fast, _, _ = door
    hit_cache_window()
    task = f"/api/v1/tasks/{toy_task}"
    send(fast, "POST", f"{task}/record", body(history=[], call=W, result={"ok": True}, exec_ms=1.0), token=auth)
    looked_up = body(history=[], call=W, rollout_id="r")
    first = send(fast, "POST", f"{task}/lookup", looked_up, token=auth)  # on the read lane: kept

    def no_lane(*args, **kwargs):
        raise AssertionError("answered on a lane")

    fast.hot.respond = no_lane
    again = send(fast, "POST", f"{task}/lookup", looked_up, token=auth)
    assert again[0] == 200 and again[2] == first[2] and json.loads(again[2])["hit"] is True
    stats = api.get(f"{task}/stats").json()
    assert (stats["calls"], stats["hits"]) == (2, 2)


def test_a_hit_from_memory_is_refused_over_the_rate_limit_and_not_counted(door, toy_task, auth, api, hit_cache_window):
    send, fast, _, _ = door
    hit_cache_window()
    task = f"/api/v1/tasks/{toy_task}"
    send(fast, "POST", f"{task}/record", body(history=[], call=W, result={"ok": True}, exec_ms=1.0), token=auth)
    looked_up = body(history=[], call=W, rollout_id="r")
    assert send(fast, "POST", f"{task}/lookup", looked_up, token=auth)[0] == 200
    Project.objects.filter(name=DEFAULT_PROJECT).update(rate_limit=1, rate_burst=1)
    tokens._verified.clear()  # the principal carries its project's limit: verified again, on the auth lane
    assert send(fast, "POST", f"{task}/lookup", looked_up, token=auth)[0] == 200  # the bucket's one request
    fast.hot.respond = None  # from here on, only the event loop may answer
    status, headers, content = send(fast, "POST", f"{task}/lookup", looked_up, token=auth)
    assert status == 429 and json.loads(content)["error"]["code"] == "rate_limited" and ("retry-after", "1") in headers
    Project.objects.filter(name=DEFAULT_PROJECT).update(rate_limit=None, rate_burst=None)
    tokens._verified.clear()
    stats = api.get(f"{task}/stats").json()
    assert (stats["calls"], stats["hits"]) == (2, 2)


def test_a_history_is_hashed_once_per_rollout_step(door, toy_task, auth, monkeypatch):
    """A rollout's next lookup sends its history again with one call more: the process kept the
    history's state chain from the last call, so each lookup hashes its own call alone, however
    long the history grows (cache.inputs.history_digests, lookup.task_chain)."""
    send, fast, _, _ = door
    task = f"/api/v1/tasks/{toy_task}"
    hashed = []
    real = match.call_digest
    monkeypatch.setattr(match, "call_digest", lambda c: hashed.append(c) or real(c))
    history = []
    for step in range(12):
        c = call("write", path=f"f{step}", content=step)
        looked = send(fast, "POST", f"{task}/lookup", body(history=history, call=c, rollout_id="r"), token=auth)
        assert json.loads(looked[2])["hit"] is False
        recorded = body(history=history, call=c, result={"ok": step}, exec_ms=1.0, rollout_id="r")
        assert send(fast, "POST", f"{task}/record", recorded, token=auth)[0] == 200
        history.append(c)
    # Each call once (its lookup's), not the history again; the first maybe twice: the process may
    # hold a handle of an earlier test's task of the same name, whose chain is then made again.
    assert len(hashed) <= len(history) + 1 and {c.to_json()["args"]["path"] for c in hashed} == {
        c["args"]["path"] for c in history
    }
    # The same history with a value of another JSON type (equal in Python: 0 == 0.0 == False)
    # is another history: never served from the memo of the first.
    for value, hit in ((0, True), (0.0, False), (False, False)):
        first = call("write", path="f0", content=value)
        answer = json.loads(send(fast, "POST", f"{task}/lookup", body(history=[first], call=history[1]), token=auth)[2])
        assert answer["hit"] is hit and (hit or answer["matched"] == 0)


@pytest.mark.django_db(transaction=True)
def test_a_misss_task_is_the_tasks_row_with_its_project():
    """task_for_miss reads in a prepared statement what a miss reads of the task and its project as
    the ORM would; the task's other fields are deferred and read on demand."""
    from cache.models import Task
    from cache.selectors import task_for_miss
    from cache.services import task_put

    task_put(
        task_id="miss-task", env={"backend": "external", "k": [1, {"a": "b"}]}, tools={"read": {"mutates_state": False}}
    )
    Project.objects.filter(pk=Task.objects.get(pk="miss-task").project_id).update(images=["x:1"], max_memory_mb=256)
    expected = Task.objects.select_related("project").get(pk="miss-task")
    read, written = task_for_miss(task_id="miss-task")
    assert written is None
    assert (read.pk, read.env, read.tools, read.project_id) == (
        expected.pk,
        expected.env,
        expected.tools,
        expected.project_id,
    )
    assert {f.attname: getattr(read.project, f.attname) for f in Project._meta.concrete_fields} == {
        f.attname: getattr(expected.project, f.attname) for f in Project._meta.concrete_fields
    }
    assert read.get_deferred_fields() >= {"name", "version", "created_at"}
    assert (read.name, read.version) == (expected.name, expected.version)  # read on demand
    assert task_for_miss(task_id="no-such-task") == (None, None)


@pytest.mark.django_db(transaction=True)
def test_a_write_rides_on_the_misss_task_read_and_comes_back_as_its_model():
    """task_for_miss's rider: the caller's UPDATE runs in the task's statement, and the row it
    wrote comes back as the ORM would read it; where it writes nothing, None."""
    from cache.models import Task
    from cache.selectors import Rider, task_for_miss
    from cache.services import task_put

    task_put(task_id="rider", env={"backend": "external"}, tools={})
    Task.objects.filter(pk="rider").update(name="before")
    rename = "UPDATE cache_task SET name = %s WHERE id = %s AND name = %s"
    task, written = task_for_miss(task_id="rider", rider=Rider(Task, rename, ("after", "rider", "before")))
    assert task.pk == "rider" and isinstance(written, Task)
    expected = Task.objects.get(pk="rider")
    assert expected.name == "after"
    assert {f.attname: getattr(written, f.attname) for f in Task._meta.concrete_fields} == {
        f.attname: getattr(expected, f.attname) for f in Task._meta.concrete_fields
    }
    task, written = task_for_miss(task_id="rider", rider=Rider(Task, rename, ("again", "rider", "before")))
    assert task.pk == "rider" and written is None and Task.objects.get(pk="rider").name == "after"


def test_what_the_server_process_made_at_startup_is_out_of_the_collectors_passes():
    """A full collection walked every object startup made (160 to 220 ms a pass under the hit
    benchmark); the ASGI module freezes them once the application is built."""
    import os
    import subprocess
    import sys

    probe = "import gc, tvcache_site.asgi; print(gc.get_freeze_count(), len(gc.get_objects()))"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tvcache_site.settings", "SECRET_KEY": "test-only"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    frozen, tracked = map(int, done.stdout.split()[-2:])
    assert frozen > 50_000 and tracked < frozen / 10  # nearly all of it frozen, little left to walk
