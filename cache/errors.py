"""Typed application errors. Each has a stable `code`; one handler turns them into API JSON."""

from __future__ import annotations

from typing import Any


class ApplicationError(Exception):
    status = 400
    code = "bad_request"
    retry_after: int | None = None  # seconds, sent as Retry-After: the condition is expected to pass

    def __init__(self, message: str, *, details: Any = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.details = details
        if code is not None:
            self.code = code

    def as_json(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "details": self.details}}


class InvalidInput(ApplicationError):
    status = 400
    code = "invalid_payload"


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


class Conflict(ApplicationError):
    status = 409
    code = "conflict"


class ServiceUnavailable(ApplicationError):
    status = 503
    code = "unavailable"
    retry_after = 1


class DatabaseUnavailable(ServiceUnavailable):
    """PostgreSQL cannot be reached or dropped the connection (a restart): nothing of the request
    was written unless it had committed, and the next request gets a new connection."""

    code = "database_unavailable"
