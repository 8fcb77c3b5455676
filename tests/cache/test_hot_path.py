"""The deployed applications answer lookup and record before Django's handler and middleware
(cache/api/lean.py: HotPathASGI, HotPathApplication for WSGI): every answer must be the one
Django gives, byte for byte, headers included, and whatever the hot path is unsure of must still
reach Django."""

from __future__ import annotations

import asyncio
import io
import json
import re

import pytest
from django.db import connections
from django.test import override_settings

from cache.api.lean import HotPathApplication, HotPathASGI
from cache.api.views import LookupView, RecordView
from sandboxes.api import RolloutCallView
from tvcache_site import asgi as asgi_module
from tvcache_site.wsgi import application as wsgi_application
from tvcache_site.wsgi import django_application

from .helpers import call

# Transactions: the hot path checks the connection like request_started does (and under ASGI
# answers on threads of its own), and a connection inside a test's atomic block looks obsolete.
pytestmark = pytest.mark.django_db(transaction=True)

W = call("write", path="f", content="1")
R = call("read", path="f")


def wsgi(app, method: str, path: str, body: bytes = b"", token: str | None = None, host: str = "127.0.0.1:8000",
         content_length: bool = True, request_id: str | None = "test-request-1"):
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": "", "SCRIPT_NAME": "",
               "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8000", "SERVER_PROTOCOL": "HTTP/1.1",
               "HTTP_HOST": host, "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(body),
               "wsgi.errors": io.StringIO(), "CONTENT_TYPE": "application/json"}
    if content_length:
        environ["CONTENT_LENGTH"] = str(len(body))
    if token is not None:
        environ["HTTP_AUTHORIZATION"] = token
    if request_id is not None:
        environ["HTTP_X_REQUEST_ID"] = request_id
    answer = {}

    def start_response(status, headers, exc_info=None):
        answer["status"], answer["headers"] = int(status.split()[0]), headers

    content = b"".join(application_iter := app(environ, start_response))
    if hasattr(application_iter, "close"):
        application_iter.close()
    return answer["status"], sorted((k.lower(), v) for k, v in answer["headers"]), content


def asgi(app, method: str, path: str, body: bytes = b"", token: str | None = None, host: str = "127.0.0.1:8000",
         content_length: bool = True, request_id: str | None = "test-request-1"):
    headers = [(b"host", host.encode()), (b"content-type", b"application/json")]
    if content_length:
        headers.append((b"content-length", str(len(body)).encode()))
    if token is not None:
        headers.append((b"authorization", token.encode()))
    if request_id is not None:
        headers.append((b"x-request-id", request_id.encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
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


def test_the_deployed_applications_take_the_hot_routes():
    for fast in (wsgi_application, asgi_module.http_application):
        assert [view for _, view in fast.hot.routes] == [LookupView, RecordView, RolloutCallView]
        assert fast.hot.enabled


@pytest.fixture(params=["asgi", "wsgi"])
def door(request):
    """(send, hot-path application, Django's application, make(views) -> hot-path application)."""
    if request.param == "wsgi":
        yield wsgi, wsgi_application, django_application, lambda views: HotPathApplication(django_application, views)
        return
    made = []

    def make(views):
        made.append(HotPathASGI(asgi_module.django_asgi, views, threads={"read": 1, "write": 1, "tool": 1}))
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
            assert len(timing) == 1 and re.fullmatch(r"queue;dur=[\d.]+, app;dur=[\d.]+, db;dur=[\d.]+, total;dur=[\d.]+", timing[0])
            headers = [(k, v) for k, v in headers if k != "server-timing"]
        assert (status, headers, answer) == send(plain, method, path, content, **kwargs)
        return status, headers, answer

    task = f"/api/v1/tasks/{toy_task}"
    for history, c, result in (([], W, {"ok": True}), ([W], R, {"output": "1"})):
        first = send(fast, "POST", f"{task}/record", body(history=history, call=c, result=result, exec_ms=1.0), token=auth)
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


def test_a_chunked_body_reaches_django(toy_task, auth):
    status = wsgi(wsgi_application, "POST", f"/api/v1/tasks/{toy_task}/lookup", body(history=[], call=R), token=auth,
                  content_length=False)[0]
    assert status == 400  # Django's WSGI handler reads no body without a Content-Length


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


def test_a_hit_is_one_query_on_the_hot_path(toy_task, auth, django_assert_num_queries):
    task = f"/api/v1/tasks/{toy_task}"
    wsgi(wsgi_application, "POST", f"{task}/record", body(history=[], call=W, result={"ok": True}, exec_ms=5.0), token=auth)
    wsgi(wsgi_application, "POST", f"{task}/lookup", body(history=[], call=W), token=auth)  # task handle cached
    with django_assert_num_queries(1):
        status, _, content = wsgi(wsgi_application, "POST", f"{task}/lookup", body(history=[], call=W), token=auth)
    assert status == 200 and json.loads(content)["hit"] is True


def test_an_unexpected_error_is_djangos_json_500(door, toy_task, auth, monkeypatch):
    send, fast, _, _ = door

    def broken(**kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(LookupView, "answer", staticmethod(broken))
    status, headers, content = send(fast, "POST", f"/api/v1/tasks/{toy_task}/lookup", body(history=[], call=R), token=auth)
    assert status == 500
    assert json.loads(content)["error"]["code"] == "internal_error"
    assert ("x-content-type-options", "nosniff") in headers


class Unread(io.RawIOBase):
    """A request body that fails the test if anything reads it."""

    def read(self, *args):
        raise AssertionError("the body was read")

    readinto = readline = read


@pytest.mark.parametrize("authorization", [None, "Token wrong", "Bearer x"])
def test_a_request_without_a_valid_token_is_refused_before_its_body_is_read(door, toy_task, authorization):
    send, fast, _, _ = door
    path = f"/api/v1/tasks/{toy_task}/lookup"
    headers = {"HTTP_AUTHORIZATION": authorization} if authorization else {}
    if send is wsgi:
        environ = {"REQUEST_METHOD": "POST", "PATH_INFO": path, "QUERY_STRING": "", "SCRIPT_NAME": "",
                   "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8000", "HTTP_HOST": "127.0.0.1:8000",
                   "wsgi.url_scheme": "http", "wsgi.input": Unread(), "wsgi.errors": io.StringIO(),
                   "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": str(2 * 1024 * 1024), **headers}
        statuses = []
        body = b"".join(fast(environ, lambda status, headers, exc_info=None: statuses.append(status)))
        status = int(statuses[0].split()[0])
    else:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"127.0.0.1:8000"), (b"content-length", str(2 * 1024 * 1024).encode()),
                             *([(b"authorization", authorization.encode())] if authorization else [])],
                 "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
        sent = []

        async def receive():
            raise AssertionError("the body was read")

        async def collect(message):
            sent.append(message)

        asyncio.run(asyncio.wait_for(fast(scope, receive, collect), 30))
        status, body = sent[0]["status"], sent[1]["body"]
    assert status == 401
    assert json.loads(body)["error"]["code"] == ("invalid_token" if authorization == "Token wrong" else "not_authenticated")
