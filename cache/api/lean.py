"""Lean dispatch for the hot endpoints (lookup, record, tool-server calls), inside Django and in
front of it.

Lookup and record run at thousands of requests per second; content negotiation, parser and
renderer selection, permission and throttle classes cost more than the lookup itself. These
views check the token and parse the JSON body themselves, and answer errors in the same JSON
shape as the exception handler. The OpenAPI schema still describes them like any DRF view.

The front doors go one step further: `HotPathASGI` (the deployed ASGI application) and
`HotPathApplication` (WSGI) answer POSTs to these endpoints with the same `lean_answer` before
Django's request handler, URL resolver and middleware chain run, and add the headers that
middleware would have added. Under WSGI that handler is a third of a worker's time per lookup
(py-spy); under ASGI it is most of it: Django gives every request a thread of its own and runs
the sync middleware through thread hops, about 6 ms of CPU per lookup against 0.7 ms here.
Anything else, and any request they are not sure about (another host, no Content-Length, moved
routes), goes to Django unchanged."""

from __future__ import annotations

import asyncio
import io
import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from http import HTTPStatus
from typing import Literal, NamedTuple

import orjson
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.core.handlers.exception import response_for_exception
from django.core.handlers.asgi import ASGIRequest
from django.core.handlers.wsgi import WSGIRequest
from django.db import DEFAULT_DB_ALIAS, connections
from django.http import HttpResponse
from django.http.request import split_domain_port, validate_host
from django.urls import Resolver404, resolve
from rest_framework.views import APIView

from cache.errors import ServiceUnavailable
from cache.inputs import load_json
from observability.logs import REQUEST_ID_HEADER, request_id, request_id_bind, request_id_unbind

from .auth import trainer_cached, trainer_for_key
from .errors import application_error

log = logging.getLogger("tvcache.api")

# An endpoint's work once the request is authenticated and parsed: JSON body out, or an
# ApplicationError with its status and code.
Answer = Callable[..., bytes]
Lane = Literal["read", "write", "tool"]


def json_response(payload: bytes, status: int = 200) -> HttpResponse:
    return HttpResponse(payload, status=status, content_type="application/json")


def error_body(code: str, message: str, details=None) -> bytes:
    return orjson.dumps({"error": {"code": code, "message": message, "details": details}})


def lean_refusal(authorization: str) -> tuple[int, bytes] | None:
    """Status and JSON body refusing a request whose token is missing or invalid; None for a
    valid one. Runs before the body is read."""
    parts = authorization.split()
    if not parts or parts[0].lower() != "token":
        return 401, error_body("not_authenticated", "Authentication credentials were not provided.")
    if len(parts) != 2 or trainer_for_key(parts[1]) is None:
        return 401, error_body("invalid_token", "Invalid or revoked token.")
    return None


def token_verified(authorization: str) -> bool:
    """The request's token was verified lately by this process (no database read): its body may
    be read before the token is checked again."""
    parts = authorization.split()
    return len(parts) == 2 and parts[0].lower() == "token" and trainer_cached(parts[1])


def lean_answer(answer: Answer, *, path_kwargs: dict[str, str], authorization: str,
                read_body: Callable[[], bytes]) -> tuple[int, bytes]:
    """Status and JSON body for a POST to a hot endpoint: token, then body, then the answer."""
    return _answered(lambda: lean_refusal(authorization) or (200, answer(**path_kwargs,
                                                                          payload=load_json(read_body()))))


def _answered(work: Callable[[], tuple[int, bytes] | None]) -> tuple[int, bytes] | None:
    """What `work` answers, with typed errors (and a database that went away) as error answers."""
    try:
        return work()
    except RequestDataTooBig:
        return 413, error_body("payload_too_large", "Request body exceeds the size limit.")
    except Exception as exc:
        error = application_error(exc)
        if error is None:
            raise
        return error.status, error_body(error.code, error.message, error.details)


def extra_headers(status: int) -> list[tuple[str, str]]:
    """What the exception handler adds to an error answer of this status."""
    if status == 401:
        return [("WWW-Authenticate", "Token")]
    if status == 503:
        return [("Retry-After", str(ServiceUnavailable.retry_after))]
    return []


# A POST endpoint whose work is `answer(*, <path arguments>, payload) -> bytes`, a staticmethod
# that the front doors call too, for requests to `route` ("/api/v1/tasks/{task_id}/lookup": the
# URL's pattern, arguments in braces). Under ASGI each `lane` has threads of its own: a lookup
# ("read") never queues behind a record waiting for its commit ("write"), and neither behind a
# tool-server call ("tool"), which executes tools and gives its connection back after each request.
# Subclasses document `post` with extend_schema_view. (A comment, not a docstring:
# drf-spectacular would publish a docstring as the operation's description.)
class LeanPostView(APIView):

    answer: Answer
    route: str
    lane: Lane = "read"

    def dispatch(self, request, *args, **kwargs):
        if request.method != "POST":
            return super().dispatch(request, *args, **kwargs)
        self.args, self.kwargs, self.request = args, kwargs, request
        return self.post(request, *args, **kwargs)

    def post(self, request, **kwargs):
        status, body = lean_answer(type(self).answer, path_kwargs=kwargs,
                                   authorization=request.META.get("HTTP_AUTHORIZATION", ""),
                                   read_body=lambda: request.body)
        response = json_response(body, status)
        for header, value in extra_headers(status):
            response[header] = value
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


def _check_connection(db, *, keep: bool) -> None:
    """What request_started and request_finished do for the one database this path uses (their
    receivers walk every connection and cache: a fifth of a lookup's CPU). With `keep`, the
    answering thread keeps its connection, even a pooled one, unless it broke: a worker process
    or a hot-path thread lives as long as the server, and taking a connection from the pool and
    giving it back on every request cost 0.17 ms of CPU per lookup and doubled the P95 at 1,024/s."""
    if keep:
        db.close_at = None  # no age limit (CONN_MAX_AGE is 0 under a pool)
    db.close_if_unusable_or_obsolete()
    if keep:
        # Without a pool, CONN_HEALTH_CHECKS would cost a round trip per lookup: a connection that
        # died (PostgreSQL restarted) answers its next request 503 instead, and the check after
        # that request closes it, so the one after reconnects.
        db.health_check_done = True


# What a path argument of a hot route matches: Django's slug and str converters.
_ARGUMENT = {"task_id": "[-a-zA-Z0-9_]+", "rollout_id": "[^/]+"}


class HotPath:
    """What both front doors share: which requests they answer, and the answer with its headers.
    A view whose route no longer resolves to it is left to Django."""

    def __init__(self, views: list[type[LeanPostView]]):
        self.routes = [(self._pattern(view.route), view) for view in views if self._routed(view)]
        # Requests this path cannot answer like the middleware would: let Django do it.
        self.enabled = bool(self.routes) and not settings.SECURE_SSL_REDIRECT and not settings.DEBUG
        self.headers = _middleware_headers()
        self.max_body = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        self.hosts: dict[str, bool] = {}  # Host header -> allowed (ALLOWED_HOSTS is fixed at start)

    @staticmethod
    def _pattern(route: str) -> re.Pattern:
        return re.compile(re.sub(r"\{(\w+)\}", lambda m: f"(?P<{m[1]}>{_ARGUMENT[m[1]]})", route) + r"\Z")

    @staticmethod
    def _routed(view: type[LeanPostView]) -> bool:
        probe = re.sub(r"\{\w+\}", "probe", view.route)
        try:
            match = resolve(probe)
        except Resolver404:
            match = None
        if match is None or getattr(match.func, "view_class", None) is not view:
            log.warning("hot path for %s disabled: %s does not lead to it", view.__name__, probe)
            return False
        return True

    def route(self, method: str, path: str, scheme: str, host: str,
              content_length: str) -> tuple[dict[str, str], type[LeanPostView]] | None:
        """(path arguments, view) for a request this path answers, else None. It answers a POST
        the middleware would pass untouched: an allowed host, over plain HTTP (no HSTS), with a
        Content-Length (a chunked body is left to Django)."""
        if not self.enabled or method != "POST" or scheme != "http" or not content_length.isdigit():
            return None
        for pattern, view in self.routes:
            match = pattern.match(path)
            if match is not None:
                return (match.groupdict(), view) if self._host_allowed(host) else None
        return None

    def _host_allowed(self, host: str) -> bool:
        allowed = self.hosts.get(host)
        if allowed is None:
            domain, _port = split_domain_port(host)
            allowed = bool(domain) and validate_host(domain, settings.ALLOWED_HOSTS)
            if len(self.hosts) < 64:  # the few names clients use; anything else is checked each time
                self.hosts[host] = allowed
        return allowed

    def too_big(self, length: int) -> bool:
        return self.max_body is not None and length > self.max_body

    def respond(self, view: type[LeanPostView], *, path_kwargs: dict[str, str], authorization: str,
                read_body: Callable[[], bytes], request: Callable[[], object], incoming_id: str | None) -> Answered:
        """Status, headers, body and the time spent in database statements; `request` builds a
        Django request for the 500 path. The request's id (`incoming_id`, the X-Request-ID header,
        if sane) is in the log lines written meanwhile and echoed, as RequestIdMiddleware does."""
        return self._run(view, lambda: lean_answer(view.answer, path_kwargs=path_kwargs, authorization=authorization,
                                                   read_body=read_body), request, incoming_id)

    def refuse(self, view: type[LeanPostView], *, authorization: str, request: Callable[[], object],
               incoming_id: str | None) -> Answered | None:
        """The answer that refuses the request's token, or None if the token is valid: the check
        that runs before the body is read (the token is then cached, see `token_verified`)."""
        return self._run(view, lambda: _answered(lambda: lean_refusal(authorization)), request, incoming_id)

    def _run(self, view: type[LeanPostView], work: Callable[[], tuple[int, bytes] | None],
             request: Callable[[], object], incoming_id: str | None) -> Answered | None:
        db = connections[DEFAULT_DB_ALIAS]
        keep = view.lane != "tool"
        timer = _StatementTimer()
        rid = request_id(incoming_id)
        bound = request_id_bind(rid)
        _check_connection(db, keep=keep)
        try:
            with db.execute_wrapper(timer):
                answered = work()
            if answered is None:
                return None
            status, body = answered
            headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                       *extra_headers(status)]
        except Exception as exc:  # the same logging, signal and JSON 500 as Django's handler
            response = response_for_exception(request(), exc)
            status, body = response.status_code, response.content
            headers = [(k, v) for k, v in response.items() if k.lower() != "content-length"]
            headers.append(("Content-Length", str(len(body))))
        finally:
            _check_connection(db, keep=keep)
            request_id_unbind(bound)
        headers.append((REQUEST_ID_HEADER, rid))
        return Answered(status, headers + self.headers, body, timer.seconds)


class Answered(NamedTuple):
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    db_s: float  # in database statements


class _StatementTimer:
    """A database execute wrapper that adds up the time statements take."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, execute, sql, params, many, context):
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            self.seconds += time.perf_counter() - started


def server_timing(arrived: float, started: float, done: float, answered: float, db_s: float) -> tuple[str, str]:
    """Where the service's time went (perf_counter seconds): waiting for a lane thread, the work
    and its database statements, the whole (the body read and the hop back to the event loop
    included), so that a client can tell its own share and the network's from the service's."""
    return ("Server-Timing", f"queue;dur={(started - arrived) * 1000:.3f}, app;dur={(done - started) * 1000:.3f}, "
                             f"db;dur={db_s * 1000:.3f}, total;dur={(answered - arrived) * 1000:.3f}")


class HotPathApplication:
    """WSGI application: POST /api/v1/tasks/<task>/<endpoint> answered by `HotPath`, the rest by
    Django."""

    def __init__(self, django_app, views: list[type[LeanPostView]]):
        self.django_app = django_app
        self.hot = HotPath(views)

    def __call__(self, environ, start_response):
        route = self.hot.route(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("wsgi.url_scheme", ""),
                               environ.get("HTTP_HOST") or environ.get("SERVER_NAME", ""),
                               environ.get("CONTENT_LENGTH", ""))
        if route is None:
            return self.django_app(environ, start_response)
        path_kwargs, view = route
        body = b""
        started = time.perf_counter()

        def read_body() -> bytes:
            nonlocal body
            length = int(environ["CONTENT_LENGTH"])
            if self.hot.too_big(length):
                raise RequestDataTooBig()
            body = environ["wsgi.input"].read(length)
            return body

        answer = self.hot.respond(
            view, path_kwargs=path_kwargs, authorization=environ.get("HTTP_AUTHORIZATION", ""), read_body=read_body,
            request=lambda: WSGIRequest({**environ, "wsgi.input": io.BytesIO(body)}),
            incoming_id=environ.get("HTTP_X_REQUEST_ID"))
        done = time.perf_counter()
        start_response(f"{answer.status} {HTTPStatus(answer.status).phrase}",
                       answer.headers + [server_timing(started, started, done, done, answer.db_s)])
        return [answer.body]


class HotPathASGI:
    """ASGI application: the same requests answered by `HotPath` on threads of its own (no thread
    per request, no hop through sync middleware), the rest by `inner`. Each lane has its threads
    (`threads`: lane -> count), which keep their connections but for the "tool" lane's; so a
    lookup never waits for a record's commit nor for a tool that runs for minutes. The body is
    read on the event loop."""

    def __init__(self, inner, views: list[type[LeanPostView]], *, threads: dict[Lane, int]):
        self.inner = inner
        self.hot = HotPath(views)
        self.executors = {lane: ThreadPoolExecutor(max_workers=count, thread_name_prefix=f"tvcache-{lane}")
                          for lane, count in threads.items()}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            route = self.hot.route(scope["method"], scope["path"], scope.get("scheme", "http"),
                                   headers.get(b"host", b"").decode("latin-1"),
                                   headers.get(b"content-length", b"").decode("latin-1"))
            if route is not None:
                return await self._answer(scope, receive, send, headers, *route)
        await self.inner(scope, receive, send)

    async def _answer(self, scope, receive, send, headers: dict[bytes, bytes], path_kwargs: dict[str, str],
                      view: type[LeanPostView]):
        arrived = time.perf_counter()
        loop = asyncio.get_running_loop()

        async def in_lane(work: Callable[[], Answered | None]) -> tuple[Answered | None, float, float]:
            def timed():
                started = time.perf_counter()
                return work(), started, time.perf_counter()
            return await loop.run_in_executor(self.executors[view.lane], timed)

        authorization = headers.get(b"authorization", b"").decode("latin-1")
        incoming_id = headers.get(b"x-request-id", b"").decode("latin-1")
        if not token_verified(authorization):
            # Checked before the body is read: a client without a valid token never gets its
            # body buffered (a flood of large unauthenticated bodies costs a header each).
            refusal, started, done = await in_lane(partial(self.hot.refuse, view, authorization=authorization,
                                                           request=lambda: ASGIRequest(scope, io.BytesIO()),
                                                           incoming_id=incoming_id))
            if refusal is not None:
                return await self._send(send, refusal, server_timing(arrived, started, done, time.perf_counter(),
                                                                     refusal.db_s))
        length = int(headers[b"content-length"])
        if self.hot.too_big(length):
            body = None  # answered 413 without reading it
        else:
            body = await self._read_body(receive)
            if body is None:  # the client went away
                return

        def read_body() -> bytes:
            if body is None:
                raise RequestDataTooBig()
            return body

        answer, started, done = await in_lane(partial(
            self.hot.respond, view, path_kwargs=path_kwargs, authorization=authorization, read_body=read_body,
            request=lambda: ASGIRequest(scope, io.BytesIO(body or b"")), incoming_id=incoming_id))
        await self._send(send, answer, server_timing(arrived, started, done, time.perf_counter(), answer.db_s))

    @staticmethod
    async def _send(send, answer: Answered, timing: tuple[str, str]) -> None:
        await send({"type": "http.response.start", "status": answer.status,
                    "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in [*answer.headers, timing]]})
        await send({"type": "http.response.body", "body": answer.body})

    @staticmethod
    async def _read_body(receive) -> bytes | None:
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)
