"""The deployed WSGI application answers lookup and record before Django's handler and middleware
(cache/api/lean.py, HotPathApplication): every answer must be the one Django gives, byte for byte,
headers included, and whatever the hot path is unsure of must still reach Django."""

from __future__ import annotations

import io
import json

import pytest
from django.test import override_settings

from cache.api.lean import HotPathApplication
from cache.api.views import LookupView, RecordView
from tvcache_site.wsgi import application, django_application

from .helpers import call

# Transactions: the hot path checks the connection like request_started does, and a connection
# inside a test's atomic block looks obsolete to that check.
pytestmark = pytest.mark.django_db(transaction=True)

W = call("write", path="f", content="1")
R = call("read", path="f")


def wsgi(app, method: str, path: str, body: bytes = b"", token: str | None = None, host: str = "127.0.0.1:8000",
         content_length: bool = True):
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": "", "SCRIPT_NAME": "",
               "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8000", "SERVER_PROTOCOL": "HTTP/1.1",
               "HTTP_HOST": host, "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(body),
               "wsgi.errors": io.StringIO(), "CONTENT_TYPE": "application/json"}
    if content_length:
        environ["CONTENT_LENGTH"] = str(len(body))
    if token is not None:
        environ["HTTP_AUTHORIZATION"] = token
    answer = {}

    def start_response(status, headers, exc_info=None):
        answer["status"], answer["headers"] = status, headers

    content = b"".join(application_iter := app(environ, start_response))
    if hasattr(application_iter, "close"):
        application_iter.close()
    return answer["status"], sorted(answer["headers"]), content


def both(method, path, body=b"", **kwargs):
    fast = wsgi(application, method, path, body, **kwargs)
    plain = wsgi(django_application, method, path, body, **kwargs)
    assert fast == plain
    return fast


@pytest.fixture
def auth(token) -> str:
    return f"Token {token}"


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_hot_path_is_enabled_for_both_routes():
    assert set(application.answers) == {"lookup", "record"}
    assert application.enabled


def test_answers_equal_djangos(toy_task, auth):
    task = f"/api/v1/tasks/{toy_task}"
    for history, c, result in (([], W, {"ok": True}), ([W], R, {"output": "1"})):
        first = wsgi(application, "POST", f"{task}/record", body(history=history, call=c, result=result, exec_ms=1.0),
                     token=auth)
        assert json.loads(first[2])["created"] is True
        again = both("POST", f"{task}/record", body(history=history, call=c, result=result, exec_ms=1.0), token=auth)
        assert json.loads(again[2])["node_id"] == json.loads(first[2])["node_id"]  # idempotent, like Django's answer
    status, _, content = both("POST", f"{task}/lookup", body(history=[W], call=R, rollout_id="r"), token=auth)
    assert status == "200 OK" and json.loads(content)["hit"] is True
    status, _, content = both("POST", f"{task}/lookup", body(history=[W, W], call=R), token=auth)
    assert json.loads(content)["hit"] is False and json.loads(content)["matched"] == 1
    for kwargs in ({}, {"token": "Token nope"}, {"token": "Bearer x"}, {"token": f"{auth} extra"}):
        status, headers, _ = both("POST", f"{task}/lookup", body(history=[], call=R), **kwargs)
        assert status == "401 Unauthorized" and ("WWW-Authenticate", "Token") in headers
    assert both("POST", f"{task}/lookup", b"{not json", token=auth)[0] == "400 Bad Request"
    assert both("POST", f"{task}/lookup", body(history="x", call=R), token=auth)[0] == "400 Bad Request"
    assert both("POST", f"{task}/record", body(history=[], call=R, result=1, exec_ms=-1), token=auth)[0] == "400 Bad Request"
    assert both("POST", "/api/v1/tasks/nope/lookup", body(history=[], call=R), token=auth)[0] == "404 Not Found"
    assert both("POST", f"{task}/lookup", body(history=[], call=R, env_fingerprint="0" * 64),
                token=auth)[0] == "409 Conflict"


def test_what_the_hot_path_is_unsure_of_reaches_django(toy_task, auth):
    task = f"/api/v1/tasks/{toy_task}"
    assert both("GET", f"{task}/lookup", token=auth)[0] == "405 Method Not Allowed"
    assert both("POST", f"{task}/lookup", body(history=[], call=R), token=auth, host="evil.example")[0] == "400 Bad Request"
    assert both("POST", f"{task}/lookup", body(history=[], call=R), token=auth, content_length=False)[0] == "400 Bad Request"
    assert both("POST", f"{task}/lookup/", body(history=[], call=R), token=auth)[0] == "404 Not Found"


def test_body_over_the_upload_limit_is_413_like_django(toy_task, auth):
    big = body(history=[call("write", path="f", content="x" * 2000)], call=R)
    with override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000):
        fast = HotPathApplication(django_application, {"lookup": LookupView})
        status, _, content = wsgi(fast, "POST", f"/api/v1/tasks/{toy_task}/lookup", big, token=auth)
        assert (status, content) == wsgi(django_application, "POST", f"/api/v1/tasks/{toy_task}/lookup", big, token=auth)[::2]
    assert status == "413 Request Entity Too Large" and json.loads(content)["error"]["code"] == "payload_too_large"


def test_a_route_that_moved_is_left_to_django():
    assert HotPathApplication(django_application, {"lookup": RecordView}).answers == {}


def test_a_hit_is_one_query_on_the_hot_path(toy_task, auth, django_assert_num_queries):
    task = f"/api/v1/tasks/{toy_task}"
    wsgi(application, "POST", f"{task}/record", body(history=[], call=W, result={"ok": True}, exec_ms=5.0), token=auth)
    wsgi(application, "POST", f"{task}/lookup", body(history=[], call=W), token=auth)  # task handle cached
    with django_assert_num_queries(1):
        status, _, content = wsgi(application, "POST", f"{task}/lookup", body(history=[], call=W), token=auth)
    assert status == "200 OK" and json.loads(content)["hit"] is True


def test_an_unexpected_error_is_djangos_json_500(toy_task, auth, monkeypatch):
    def broken(**kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(application, "answers", {**application.answers, "lookup": broken})
    status, headers, content = wsgi(application, "POST", f"/api/v1/tasks/{toy_task}/lookup", body(history=[], call=R),
                                    token=auth)
    assert status == "500 Internal Server Error"
    assert json.loads(content)["error"]["code"] == "internal_error"
    assert ("X-Content-Type-Options", "nosniff") in headers
