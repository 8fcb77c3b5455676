"""Typed application errors. Each has a stable `code` and status; `body` and `headers` are the
one error answer every front door sends (core.api.errors turns exceptions into them)."""

from __future__ import annotations

from typing import Any

import orjson


class ApplicationError(Exception):
    status = 400
    code = "bad_request"
    retry_after: int | None = None  # seconds, sent as Retry-After: the condition is expected to pass
    challenge: str | None = None  # sent as WWW-Authenticate: the credentials the answer asks for

    def __init__(self, message: str, *, details: Any = None, code: str | None = None, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.details = details
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def body(self) -> bytes:
        """The API's error JSON: {"error": {"code", "message", "details"}}."""
        return orjson.dumps(
            {"error": {"code": self.code, "message": self.message, "details": self.details}},
            option=orjson.OPT_NON_STR_KEYS,
        )  # DRF's list errors key by index

    def headers(self) -> list[tuple[str, str]]:
        headers = []
        if self.challenge is not None:
            headers.append(("WWW-Authenticate", self.challenge))
        if self.retry_after is not None:
            headers.append(("Retry-After", str(self.retry_after)))
        return headers


class InvalidInput(ApplicationError):
    status = 400
    code = "invalid_payload"


class NotAuthenticated(ApplicationError):
    """No valid credentials (a session page's login, or an API token: then `challenge` is "Token")."""

    status = 401
    code = "not_authenticated"


class Forbidden(ApplicationError):
    """Allowed to no caller of this service: more than the operator grants."""

    status = 403
    code = "forbidden"


class PayloadTooLarge(ApplicationError):
    status = 413
    code = "payload_too_large"


class NotFound(ApplicationError):
    status = 404
    code = "not_found"


class MethodNotAllowed(ApplicationError):
    status = 405
    code = "method_not_allowed"


class Conflict(ApplicationError):
    status = 409
    code = "conflict"


class InternalError(ApplicationError):
    """A bug: the answer says what a client may rely on, nothing of the cause."""

    status = 500
    code = "internal_error"


class ServiceUnavailable(ApplicationError):
    status = 503
    code = "unavailable"
    retry_after = 1


class DatabaseUnavailable(ServiceUnavailable):
    """PostgreSQL cannot be reached or dropped the connection (a restart): nothing of the request
    was written unless it had committed, and the next request gets a new connection."""

    code = "database_unavailable"


class Overloaded(ServiceUnavailable):
    """Every thread of a lane is busy and its queue is full: refused at once rather than queued
    without bound (the client retries after Retry-After)."""

    code = "overloaded"


class TooManyRequests(ApplicationError):
    """Over a project's quota for now (its rate limit, its live sandboxes): retry shortly. Every
    such limit admits at least one request per second, so Retry-After is 1."""

    status = 429
    code = "too_many_requests"
    retry_after = 1


class RateLimited(TooManyRequests):
    code = "rate_limited"
