"""Lean dispatch for the hot endpoints (lookup, record), inside Django and in front of it.

Lookup and record run at thousands of requests per second; content negotiation, parser and
renderer selection, permission and throttle classes cost more than the lookup itself. These
views check the token and parse the JSON body themselves, and answer errors in the same JSON
shape as the exception handler. The OpenAPI schema still describes them like any DRF view.

`HotPathApplication` goes one step further for the deployed WSGI server: it answers POSTs to
the two endpoints with the same `lean_answer` before Django's request handler, URL resolver and
middleware chain run (a third of a worker's time per lookup, measured with py-spy), and adds
the headers that middleware would have added. Anything else, and any request it is not sure
about (another host, no Content-Length, moved routes), goes to Django unchanged.
"""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Callable
from http import HTTPStatus

import orjson
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.core.handlers.exception import response_for_exception
from django.core.handlers.wsgi import WSGIHandler, WSGIRequest
from django.db import DEFAULT_DB_ALIAS, connections
from django.http import HttpResponse
from django.http.request import split_domain_port, validate_host
from django.urls import Resolver404, resolve
from rest_framework.views import APIView

from cache.errors import ApplicationError

from .auth import trainer_for_key

log = logging.getLogger("tvcache.api")

# An endpoint's work once the request is authenticated and parsed: JSON body out, or an
# ApplicationError with its status and code.
Answer = Callable[..., bytes]


def json_response(payload: bytes, status: int = 200) -> HttpResponse:
    return HttpResponse(payload, status=status, content_type="application/json")


def error_body(code: str, message: str, details=None) -> bytes:
    return orjson.dumps({"error": {"code": code, "message": message, "details": details}})


def lean_answer(answer: Answer, *, task_id: str, authorization: str, read_body: Callable[[], bytes]) -> tuple[int, bytes]:
    """Status and JSON body for a POST to a hot endpoint: token, then body, then the answer."""
    parts = authorization.split()
    if not parts or parts[0].lower() != "token":
        return 401, error_body("not_authenticated", "Authentication credentials were not provided.")
    if len(parts) != 2 or trainer_for_key(parts[1]) is None:
        return 401, error_body("invalid_token", "Invalid or revoked token.")
    try:
        payload = orjson.loads(read_body())
    except orjson.JSONDecodeError as exc:
        return 400, error_body("malformed_json", f"Malformed JSON: {exc}")
    except RequestDataTooBig:
        return 413, error_body("payload_too_large", "Request body exceeds the size limit.")
    try:
        return 200, answer(task_id=task_id, payload=payload)
    except ApplicationError as exc:
        return exc.status, error_body(exc.code, exc.message, exc.details)


# A POST endpoint whose work is `answer(*, task_id, payload) -> bytes`, a staticmethod that
# HotPathApplication calls too. Subclasses document `post` with extend_schema_view. (A comment,
# not a docstring: drf-spectacular would publish a docstring as the operation's description.)
class LeanPostView(APIView):

    answer: Answer

    def dispatch(self, request, *args, **kwargs):
        if request.method != "POST":
            return super().dispatch(request, *args, **kwargs)
        self.args, self.kwargs, self.request = args, kwargs, request
        return self.post(request, *args, **kwargs)

    def post(self, request, task_id: str):
        status, body = lean_answer(type(self).answer, task_id=task_id,
                                   authorization=request.META.get("HTTP_AUTHORIZATION", ""),
                                   read_body=lambda: request.body)
        response = json_response(body, status)
        if status == 401:
            response["WWW-Authenticate"] = "Token"
        return response


def _middleware_headers() -> list[tuple[str, str]]:
    """What SecurityMiddleware and XFrameOptionsMiddleware add to a plain-HTTP JSON response."""
    headers = []
    if settings.X_FRAME_OPTIONS:
        headers.append(("X-Frame-Options", settings.X_FRAME_OPTIONS.upper()))
    if settings.SECURE_CONTENT_TYPE_NOSNIFF:
        headers.append(("X-Content-Type-Options", "nosniff"))
    policy = settings.SECURE_REFERRER_POLICY
    if policy:
        values = [v.strip() for v in policy.split(",")] if isinstance(policy, str) else list(policy)
        headers.append(("Referrer-Policy", ",".join(values)))
    if settings.SECURE_CROSS_ORIGIN_OPENER_POLICY:
        headers.append(("Cross-Origin-Opener-Policy", settings.SECURE_CROSS_ORIGIN_OPENER_POLICY))
    return headers


class HotPathApplication:
    """WSGI application: POST /api/v1/tasks/<task>/<endpoint> answered by `lean_answer`, the
    rest by Django. `views` maps an endpoint name ("lookup") to its LeanPostView; an endpoint
    whose route no longer resolves to that view is left to Django."""

    PATH = re.compile(r"/api/v1/tasks/([-a-zA-Z0-9_]+)/([a-z]+)\Z")  # the <slug:task_id> converter

    def __init__(self, django_app: WSGIHandler, views: dict[str, type[LeanPostView]]):
        self.django_app = django_app
        self.answers = {name: view.answer for name, view in views.items() if self._routed(name, view)}
        # Requests this path cannot answer like the middleware would: let Django do it.
        self.enabled = bool(self.answers) and not settings.SECURE_SSL_REDIRECT and not settings.DEBUG
        self.headers = _middleware_headers()
        self.max_body = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        self.hosts: dict[str, bool] = {}  # Host header -> allowed (ALLOWED_HOSTS is fixed at start)

    @staticmethod
    def _routed(name: str, view: type[LeanPostView]) -> bool:
        try:
            match = resolve(f"/api/v1/tasks/probe/{name}")
        except Resolver404:
            match = None
        if match is None or getattr(match.func, "view_class", None) is not view:
            log.warning("hot path for '%s' disabled: the route does not lead to %s", name, view.__name__)
            return False
        return True

    def __call__(self, environ, start_response):
        if self.enabled and environ["REQUEST_METHOD"] == "POST":
            match = self.PATH.match(environ.get("PATH_INFO", ""))
            if match is not None and match[2] in self.answers and self._plain_request(environ):
                return self._answer(environ, start_response, match[1], self.answers[match[2]])
        return self.django_app(environ, start_response)

    def _plain_request(self, environ) -> bool:
        """A request the middleware would pass untouched: an allowed host, over plain HTTP (no
        HSTS), with a Content-Length (a chunked body is left to Django)."""
        if environ.get("wsgi.url_scheme") != "http" or not environ.get("CONTENT_LENGTH", "").isdigit():
            return False
        host = environ.get("HTTP_HOST") or environ.get("SERVER_NAME", "")
        allowed = self.hosts.get(host)
        if allowed is None:
            domain, _port = split_domain_port(host)
            allowed = bool(domain) and validate_host(domain, settings.ALLOWED_HOSTS)
            if len(self.hosts) < 64:  # the few names clients use; anything else is checked each time
                self.hosts[host] = allowed
        return allowed

    def _read_body(self, environ) -> bytes:
        length = int(environ["CONTENT_LENGTH"])
        if self.max_body is not None and length > self.max_body:
            raise RequestDataTooBig()
        body = environ["wsgi.input"].read(length)
        environ["tvcache.body"] = body
        return body

    def _answer(self, environ, start_response, task_id: str, answer: Answer):
        db = connections[DEFAULT_DB_ALIAS]
        # What request_started and request_finished do for the one database this path uses (the
        # signals' receivers walk every connection and cache: a fifth of a lookup's CPU).
        db.close_if_unusable_or_obsolete()
        try:
            status, body = lean_answer(answer, task_id=task_id, authorization=environ.get("HTTP_AUTHORIZATION", ""),
                                       read_body=lambda: self._read_body(environ))
            headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
            if status == 401:
                headers.append(("WWW-Authenticate", "Token"))
        except Exception as exc:  # the same logging, signal and JSON 500 as Django's handler
            status, headers, body = self._unexpected(environ, exc)
        finally:
            db.close_if_unusable_or_obsolete()
        start_response(f"{status} {HTTPStatus(status).phrase}", headers + self.headers)
        return [body]

    @staticmethod
    def _unexpected(environ, exc: Exception) -> tuple[int, list[tuple[str, str]], bytes]:
        environ = {**environ, "wsgi.input": io.BytesIO(environ.get("tvcache.body", b""))}
        response = response_for_exception(WSGIRequest(environ), exc)
        body = response.content
        headers = [(k, v) for k, v in response.items() if k.lower() != "content-length"]
        return response.status_code, [*headers, ("Content-Length", str(len(body)))], body
