"""The front door: how the hot endpoints (lookup, record, tool-server calls) are answered, inside
Django and in front of it.

Lookup and record run at thousands of requests per second; content negotiation, parser and
renderer selection, permission and throttle classes cost more than the lookup itself. These
views (`FrontDoorView`) check the token and parse the JSON body themselves, and answer errors as
the exception handler does (core/api/errors.py). The OpenAPI schema still describes them like
any DRF view.

`FrontDoorASGI` (the deployed ASGI application) goes one step further: it answers POSTs to these
endpoints with the same `front_door_answer` on its lanes (core/lanes.py) before Django's request
handler, URL resolver and middleware chain run, and adds the headers that middleware would have
added; Django's handler would otherwise be most of a lookup's time (docs/design/hot-path.md).
Anything else, and any request it is not sure about (another host, no Content-Length, moved
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
from typing import Literal, NamedTuple

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.core.handlers.asgi import ASGIRequest
from django.core.handlers.exception import response_for_exception
from django.db import DEFAULT_DB_ALIAS, connections
from django.http import HttpResponse
from django.http.request import split_domain_port, validate_host
from django.urls import Resolver404, resolve
from rest_framework.views import APIView

from accounts.services.tokens import INVALID_TOKEN, Principal, admit, principal_cached, principal_for_key
from core.api.errors import application_error
from core.errors import NotAuthenticated, Overloaded
from core.inputs import load_json
from core.lanes import ClaimAwaited, HandBack, LaneContext, SlowWork, lane_current, lane_set
from observability.logs import REQUEST_ID_HEADER, request_id, request_id_bind, request_id_unbind

from .claimwatch import ClaimWatch

log = logging.getLogger("tvcache.api")

# An endpoint's work once the request is authenticated and parsed: JSON body out, or an
# ApplicationError with its status and code; or, on a lane, the request handed back (core/lanes.py).
Answer = Callable[..., bytes | HandBack]
# The same from memory alone, given `admit` to call once the answer is certain; None: not from memory.
AnswerInMemory = Callable[..., bytes | None]
# An answer's status, JSON body and the headers an error answer adds.
Reply = tuple[int, bytes, list[tuple[str, str]]]
# Under ASGI: "read" lookups, "write" records, "tool" tool-server calls until they need a tool run
# ("exec"), "auth" token checks of requests whose token this process has not verified lately.
Lane = Literal["read", "write", "tool", "exec", "auth"]


def json_response(payload: bytes, status: int = 200) -> HttpResponse:
    return HttpResponse(payload, status=status, content_type="application/json")


class TokenRequired(NotAuthenticated):
    challenge = "Token"  # the scheme TrainerTokenAuthentication names to DRF


def front_door_principal(authorization: str) -> Principal:
    """The request's principal (its token's project and role); TokenRequired (401) for a token
    that is missing or invalid."""
    parts = authorization.split()
    if not parts or parts[0].lower() != "token":
        raise TokenRequired("Authentication credentials were not provided.")
    principal = principal_for_key(parts[1]) if len(parts) == 2 else None
    if principal is None:
        raise TokenRequired(INVALID_TOKEN, code="invalid_token")
    return principal


def front_door_refusal(authorization: str) -> Reply | None:
    """The answer refusing a request whose token is missing or invalid; None for a valid one.
    Runs before the body is read."""

    def check() -> None:
        front_door_principal(authorization)

    return _answered(check)


def token_verified(authorization: str) -> Principal | None:
    """The request's principal if its token was verified lately by this process (no database
    read): its body may be read before the token is checked again."""
    parts = authorization.split()
    return principal_cached(parts[1]) if len(parts) == 2 and parts[0].lower() == "token" else None


def front_door_answer(
    answer: Answer, *, path_kwargs: dict[str, str], authorization: str, read_body: Callable[[], bytes]
) -> Reply | HandBack:
    """The answer to a POST to a hot endpoint: token, its project's rate limit, then body, then
    the answer (which gets the principal: the task id resolves in its project)."""

    def work() -> Reply:
        principal = front_door_principal(authorization)
        lane = lane_current()
        if lane is None or not lane.rerun:  # a request handed back and run again counts once
            admit(principal)
        body = answer(principal=principal, **path_kwargs, payload=load_json(read_body()))
        return body if isinstance(body, HandBack) else (200, body, [])

    return _answered(work)


def front_door_answer_in_memory(
    answer_in_memory: AnswerInMemory, *, principal: Principal, path_kwargs: dict[str, str], body: bytes
) -> Reply | None:
    """The answer the process can give from memory alone, on the event loop (no statement, no
    wait: a hit from the hit cache), or None: then the lane answers the request as it always
    does, errors included. The request is admitted against its project's rate limit only once the
    answer is certain, so a request answered by the lane is admitted once."""
    admitted = []

    def admit_once() -> None:
        admitted.append(True)
        admit(principal)

    try:
        answer = answer_in_memory(principal=principal, **path_kwargs, payload=load_json(body), admit=admit_once)
    except Exception as exc:
        if not admitted:
            return None
        error = application_error(exc)
        if error is None:
            raise
        return error.status, error.body(), error.headers()
    return None if answer is None else (200, answer, [])


def _answered(work: Callable[[], Reply | HandBack | None]) -> Reply | HandBack | None:
    """What `work` answers, with typed errors (and a database that went away) as error answers."""
    try:
        return work()
    except Exception as exc:
        error = application_error(exc)
        if error is None:
            raise
        return error.status, error.body(), error.headers()


# A POST endpoint whose work is `answer(*, principal, <path arguments>, payload) -> bytes`, a staticmethod
# that the front door calls too, for requests to `route` ("/api/v1/tasks/{task_id}/lookup": the
# URL's pattern, arguments in braces). Under ASGI each `lane` has threads of its own: a lookup
# ("read") never queues behind a record waiting for its commit ("write"), and neither behind a
# tool-server call ("tool"); a tool-server call that must run a tool moves on to the "exec" lane,
# so tool-server hits never queue behind tool runs either (core/lanes.py).
# Subclasses document `post` with extend_schema_view. (A comment, not a docstring:
# drf-spectacular would publish a docstring as the operation's description.)
class FrontDoorView(APIView):
    answer: Answer
    answer_in_memory: AnswerInMemory | None = None  # under ASGI, tried on the event loop first
    route: str
    lane: Lane = "read"

    @classmethod
    def first_lane(cls, path_kwargs: dict[str, str]) -> Lane:
        """The lane a request starts on under ASGI: the view's, unless the view knows where its
        work will end up (a guess: the work itself decides, core/lanes.py)."""
        return cls.lane

    def dispatch(self, request, *args, **kwargs):
        if request.method != "POST":
            return super().dispatch(request, *args, **kwargs)
        self.args, self.kwargs, self.request = args, kwargs, request
        return self.post(request, *args, **kwargs)

    def post(self, request, **kwargs):
        status, body, headers = front_door_answer(
            type(self).answer,
            path_kwargs=kwargs,
            authorization=request.META.get("HTTP_AUTHORIZATION", ""),
            read_body=lambda: request.body,
        )
        response = json_response(body, status)
        for header, value in headers:
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


class FrontDoor:
    """What the front door answers itself: which requests, and the answer with its headers.
    A view whose route no longer resolves to it is left to Django."""

    def __init__(self, views: list[type[FrontDoorView]]):
        self.routes = [(self._pattern(view.route), view) for view in views if self._routed(view)]
        # Requests this path cannot answer like the middleware would: let Django do it.
        self.enabled = bool(self.routes) and not settings.SECURE_SSL_REDIRECT and not settings.DEBUG
        # What every answer carries, encoded once for the ASGI server (FrontDoorASGI._send).
        self.headers = _encoded(_middleware_headers())
        self.max_body = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        self.hosts: dict[str, bool] = {}  # Host header -> allowed (ALLOWED_HOSTS is fixed at start)
        # Path -> (arguments, view) or None, for the paths clients send (one per task and endpoint).
        self.paths: dict[str, tuple[dict[str, str], type[FrontDoorView]] | None] = {}

    @staticmethod
    def _pattern(route: str) -> re.Pattern:
        return re.compile(re.sub(r"\{(\w+)\}", lambda m: f"(?P<{m[1]}>{_ARGUMENT[m[1]]})", route) + r"\Z")

    @staticmethod
    def _routed(view: type[FrontDoorView]) -> bool:
        probe = re.sub(r"\{\w+\}", "probe", view.route)
        try:
            match = resolve(probe)
        except Resolver404:
            match = None
        if match is None or getattr(match.func, "view_class", None) is not view:
            log.warning("hot path for %s disabled: %s does not lead to it", view.__name__, probe)
            return False
        return True

    def route(
        self, method: str, path: str, scheme: str, host: str, content_length: str
    ) -> tuple[dict[str, str], type[FrontDoorView]] | None:
        """(path arguments, view) for a request this path answers, else None. It answers a POST
        the middleware would pass untouched: an allowed host, over plain HTTP (no HSTS), with a
        Content-Length (a chunked body is left to Django)."""
        if not self.enabled or method != "POST" or scheme != "http" or not content_length.isdigit():
            return None
        routed = self.paths.get(path, False)
        if routed is False:
            routed = self._routed_path(path)
        return routed if routed is not None and self._host_allowed(host) else None

    def _routed_path(self, path: str) -> tuple[dict[str, str], type[FrontDoorView]] | None:
        routed = None
        for pattern, view in self.routes:
            match = pattern.match(path)
            if match is not None:
                routed = match.groupdict(), view
                break
        if len(self.paths) < 4096:  # beyond: matched each time
            self.paths[path] = routed
        return routed

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

    def respond(
        self,
        view: type[FrontDoorView],
        *,
        path_kwargs: dict[str, str],
        authorization: str,
        read_body: Callable[[], bytes],
        request: Callable[[], object],
        incoming_id: str | None,
        lane: Lane | None = None,
        context: LaneContext | None = None,
    ) -> Answered | HandBack:
        """Status, headers, body and the time spent in database statements; `request` builds a
        Django request for the 500 path. The request's id (`incoming_id`, the X-Request-ID header,
        if sane) is in the log lines written meanwhile and echoed, as RequestIdMiddleware does.
        Run on `lane` (default the view's) with `context`, the work may hand the request back
        instead (core/lanes.py): then the HandBack is returned."""
        return self._run(
            lane or view.lane,
            lambda: front_door_answer(
                view.answer, path_kwargs=path_kwargs, authorization=authorization, read_body=read_body
            ),
            request,
            incoming_id,
            context,
        )

    def refuse(
        self,
        view: type[FrontDoorView],
        *,
        authorization: str,
        request: Callable[[], object],
        incoming_id: str | None,
        lane: Lane | None = None,
    ) -> Answered | None:
        """The answer that refuses the request's token, or None if the token is valid: the check
        that runs before the body is read (the token is then cached, see `token_verified`)."""
        return self._run(lane or view.lane, lambda: front_door_refusal(authorization), request, incoming_id)

    def plain(self, reply: Reply, rid: str) -> Answered:
        """An answer made without a thread or the database (a refusal on the event loop)."""
        status, body, extra = reply
        headers = [_JSON, (b"content-length", b"%d" % len(body))]
        if extra:
            headers += _encoded(extra)
        headers.append((_REQUEST_ID, rid.encode("latin-1")))
        return Answered(status, headers, body, 0.0)

    def overloaded(self, lane: str, rid: str) -> Answered:
        error = Overloaded(f"The service is at capacity ({lane}); retry shortly.", details={"lane": lane})
        return self.plain((error.status, error.body(), error.headers()), rid)

    def _run(
        self,
        lane: Lane,
        work: Callable[[], Reply | HandBack | None],
        request: Callable[[], object],
        incoming_id: str | None,
        context: LaneContext | None = None,
    ) -> Answered | HandBack | None:
        db = connections[DEFAULT_DB_ALIAS]
        keep = lane != "exec"  # an exec lane thread runs tools for minutes: it holds no connection meanwhile
        timer = _StatementTimer()
        rid = request_id(incoming_id)
        bound = request_id_bind(rid)
        _check_connection(db, keep=keep)
        if context is not None:
            lane_set(context)
        try:
            with db.execute_wrapper(timer):
                answered = work()
            if answered is None:
                return None
            if isinstance(answered, HandBack):
                answered.db_s = timer.seconds
                return answered
            status, body, extra = answered
            headers = [_JSON, (b"content-length", b"%d" % len(body)), *_encoded(extra)]
        except Exception as exc:  # the same logging, signal and JSON 500 as Django's handler
            response = response_for_exception(request(), exc)
            status, body = response.status_code, response.content
            headers = _encoded([(k, v) for k, v in response.items() if k.lower() != "content-length"])
            headers.append((b"content-length", b"%d" % len(body)))
        finally:
            if context is not None:
                lane_set(None)
            _check_connection(db, keep=keep)
            request_id_unbind(bound)
        headers.append((_REQUEST_ID, rid.encode("latin-1")))
        return Answered(status, headers, body, timer.seconds)


# Headers as the ASGI server takes them: names in lower case, bytes.
_JSON = (b"content-type", b"application/json")
_REQUEST_ID = REQUEST_ID_HEADER.lower().encode("latin-1")


def _encoded(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers]


class Answered(NamedTuple):
    status: int
    # Its own, encoded (_encoded); the ASGI app adds those every answer carries (FrontDoor.headers).
    headers: list[tuple[bytes, bytes]]
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


def server_timing(*, queue_s: float, app_s: float, db_s: float, total_s: float, wait_s: float = 0.0) -> bytes:
    """The Server-Timing header's value: where the service's time went: waiting for lane threads,
    the work and its database statements, waiting on the event loop for another request's tool
    run (only when it did), the whole (the body read and the hops back to the event loop
    included), so that a client can tell its own share and the network's from the service's."""
    waited = b"wait;dur=%.3f, " % (wait_s * 1000) if wait_s else b""
    return b"queue;dur=%s, app;dur=%.3f, db;dur=%s, %stotal;dur=%.3f" % (
        _ms(queue_s),
        app_s * 1000,
        _ms(db_s),
        waited,
        total_s * 1000,
    )


def _ms(seconds: float) -> bytes:
    return b"%.3f" % (seconds * 1000) if seconds else b"0.000"  # (a hit from memory: no queue, no statement)


class _Clock:
    """A request's time on the ASGI front door, over every lane it ran on (Server-Timing)."""

    def __init__(self) -> None:
        self.arrived = time.perf_counter()
        self.queue_s = self.app_s = self.db_s = self.wait_s = 0.0

    def header(self, answer: Answered) -> bytes:
        return server_timing(
            queue_s=self.queue_s,
            app_s=self.app_s,
            db_s=self.db_s + answer.db_s,
            total_s=time.perf_counter() - self.arrived,
            wait_s=self.wait_s,
        )


class FrontDoorASGI:
    """ASGI application: the same requests answered by `FrontDoor` on threads of its own (no thread
    per request, no hop through sync middleware), the rest by `inner`. Each lane has its threads
    (`threads`: lane -> count), which keep their connections but for the "exec" lane's; so a
    lookup never waits for a record's commit nor for a tool that runs for minutes. The body is
    read on the event loop.

    Overload answers 503 `overloaded` with Retry-After at once, never a pile-up: a lane takes at
    most its threads plus `queue[lane]` requests (running or waiting for a thread), and at most
    `waiters` requests wait on the event loop for another request's tool run (single flight). A
    request without a well-formed token is refused on the event loop; a token this process has
    not verified lately is checked on the "auth" lane before the body is read, so a flood of
    requests with bad tokens and large bodies costs a header each and queues behind no hit."""

    def __init__(
        self,
        inner,
        views: list[type[FrontDoorView]],
        *,
        threads: dict[Lane, int],
        queue: dict[Lane, int] | None = None,
        waiters: int = 1024,
    ):
        self.inner = inner
        self.hot = FrontDoor(views)
        threads = {"auth": 1, "exec": threads.get("tool", 1), **threads}
        self.executors = {
            lane: ThreadPoolExecutor(max_workers=count, thread_name_prefix=f"tvcache-{lane}")
            for lane, count in threads.items()
        }
        self.capacity = {lane: count + (queue or {}).get(lane, 256) for lane, count in threads.items()}
        self.busy = dict.fromkeys(threads, 0)  # requests running on a lane or waiting for one of its threads
        self.claims = ClaimWatch()
        self.waiters, self.waiting = waiters, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            route = self.hot.route(
                scope["method"],
                scope["path"],
                scope.get("scheme", "http"),
                headers.get(b"host", b"").decode("latin-1"),
                headers.get(b"content-length", b"").decode("latin-1"),
            )
            if route is not None:
                return await self._answer(scope, receive, send, headers, *route)
        await self.inner(scope, receive, send)

    async def _in_lane(
        self, lane: Lane, work: Callable[[], Answered | HandBack | None], clock: _Clock, rid: str
    ) -> Answered | HandBack | None:
        """What `work` answers, run on a thread of `lane`; 503 overloaded if the lane is full."""
        if self.busy[lane] >= self.capacity[lane]:
            return self.hot.overloaded(f"{lane} lane", rid)
        self.busy[lane] += 1
        submitted = time.perf_counter()

        def timed():
            started = time.perf_counter()
            return work(), started, time.perf_counter()

        try:
            answer, started, done = await asyncio.get_running_loop().run_in_executor(self.executors[lane], timed)
        finally:
            self.busy[lane] -= 1
        clock.queue_s += started - submitted
        clock.app_s += done - started
        if isinstance(answer, HandBack):
            clock.db_s += answer.db_s
        return answer

    async def _refusal(
        self, view: type[FrontDoorView], scope, authorization: str, rid: str, clock: _Clock
    ) -> Answered | None:
        """The answer refusing the request's token (None: valid), before the body is read."""
        parts = authorization.split()
        if len(parts) != 2 or parts[0].lower() != "token":  # malformed: no database needed
            return self.hot.plain(front_door_refusal(authorization), rid)
        return await self._in_lane(
            "auth",
            partial(
                self.hot.refuse,
                view,
                authorization=authorization,
                lane="auth",
                request=lambda: ASGIRequest(scope, io.BytesIO()),
                incoming_id=rid,
            ),
            clock,
            rid,
        )

    async def _answer(
        self, scope, receive, send, headers: dict[bytes, bytes], path_kwargs: dict[str, str], view: type[FrontDoorView]
    ):
        clock = _Clock()
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        rid = request_id(headers.get(b"x-request-id", b"").decode("latin-1"))
        principal = token_verified(authorization)
        if principal is None:
            # Checked before the body is read: a client without a valid token never gets its
            # body buffered (a flood of large unauthenticated bodies costs a header each).
            refusal = await self._refusal(view, scope, authorization, rid, clock)
            if refusal is not None:
                return await self._send(send, refusal, clock.header(refusal), unread=headers[b"content-length"] != b"0")
        length = int(headers[b"content-length"])
        if self.hot.too_big(length):
            body = None  # answered 413 without reading it
        else:
            body = await self._read_body(receive)
            if body is None:  # the client went away
                return

        if principal is not None and body is not None and view.answer_in_memory is not None:
            started = time.perf_counter()
            reply = front_door_answer_in_memory(
                view.answer_in_memory, principal=principal, path_kwargs=path_kwargs, body=body
            )
            clock.app_s += time.perf_counter() - started
            if reply is not None:
                answer = self.hot.plain(reply, rid)
                return await self._send(send, answer, clock.header(answer))

        def read_body() -> bytes:
            if body is None:
                raise RequestDataTooBig()
            return body

        respond = partial(
            self.hot.respond,
            view,
            path_kwargs=path_kwargs,
            authorization=authorization,
            read_body=read_body,
            request=lambda: ASGIRequest(scope, io.BytesIO(body or b"")),
            incoming_id=rid,
        )
        answer = await self._handed_on(view, view.first_lane(path_kwargs), respond, clock, rid)
        await self._send(send, answer, clock.header(answer), unread=body is None and length > 0)

    async def _handed_on(
        self,
        view: type[FrontDoorView],
        lane: Lane,
        respond: Callable[..., Answered | HandBack],
        clock: _Clock,
        rid: str,
    ) -> Answered:
        """The answer of `respond` on `lane` (where the request starts), following the work where
        it hands the request back (core/lanes.py): on to the "exec" lane, or back to the view's
        lane once the claim it waits for is free."""
        wait_until, rerun = None, False
        while True:
            context = LaneContext(
                fast=lane == "tool", waited_s=clock.wait_s, wait_until=wait_until, rerun=rerun, arrived=clock.arrived
            )
            rerun = True
            answer = await self._in_lane(lane, partial(respond, lane=lane, context=context), clock, rid)
            if isinstance(answer, SlowWork):
                lane = "exec"
            elif isinstance(answer, ClaimAwaited):
                if self.waiting >= self.waiters:
                    return self.hot.overloaded("single-flight waiters", rid)
                now = time.monotonic()
                wait_until = wait_until or now + answer.wait_s
                self.waiting += 1
                try:
                    await self.claims.released(answer.key, max(0.0, wait_until - now))
                finally:
                    self.waiting -= 1
                    clock.wait_s += time.monotonic() - now
                lane = view.lane
            else:
                return answer

    async def _send(self, send, answer: Answered, timing: bytes, unread: bool = False) -> None:
        """The answer with its Server-Timing `timing`; with `unread` (a body left unread) the
        connection is closed after it, rather than the server reading and dropping the rest of the
        body to keep it alive."""
        headers = [*answer.headers, (b"server-timing", timing), *self.hot.headers]
        if unread:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
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
