"""The one place where exceptions become the API's error JSON."""

from __future__ import annotations

import psycopg
from django.core.exceptions import RequestDataTooBig
from django.db import InterfaceError, OperationalError
from rest_framework import exceptions as drf
from rest_framework.response import Response

from cache.errors import ApplicationError, DatabaseUnavailable

DRF_CODES = {
    drf.ParseError: "malformed_json",
    drf.NotAuthenticated: "not_authenticated",
    drf.AuthenticationFailed: "invalid_token",
    drf.PermissionDenied: "permission_denied",
    drf.NotFound: "not_found",
    drf.MethodNotAllowed: "method_not_allowed",
    drf.UnsupportedMediaType: "unsupported_media_type",
    drf.NotAcceptable: "not_acceptable",
    drf.Throttled: "throttled",
    drf.ValidationError: "invalid_payload",
}

# PostgreSQL went away (a restart, a dropped connection, no free connection): the request is
# answered 503 and the connection is dropped, so the next request gets a healthy one. Django
# translates psycopg's errors; the psycopg classes are for connections used directly.
DATABASE_DOWN = (OperationalError, InterfaceError, psycopg.OperationalError, psycopg.InterfaceError)


def application_error(exc: BaseException) -> ApplicationError | None:
    """The typed error an exception answers as, or None for a bug (a 500)."""
    if isinstance(exc, ApplicationError):
        return exc
    if isinstance(exc, DATABASE_DOWN):
        return DatabaseUnavailable("The database is unavailable (restarting or unreachable); retry shortly.")
    return None


def error_response(status: int, code: str, message: str, details=None) -> Response:
    return Response({"error": {"code": code, "message": message, "details": details}}, status=status)


def exception_handler(exc, context):
    error = application_error(exc)
    if error is not None:
        response = error_response(error.status, error.code, error.message, error.details)
        if error.retry_after is not None:
            response["Retry-After"] = str(error.retry_after)
        return response
    if isinstance(exc, RequestDataTooBig):
        return error_response(413, "payload_too_large", "Request body exceeds the size limit.")
    if isinstance(exc, drf.APIException):
        code = DRF_CODES.get(type(exc), "bad_request")
        if isinstance(exc, drf.ValidationError):
            return error_response(exc.status_code, code, "Invalid input.", exc.detail)
        if isinstance(exc, drf.AuthenticationFailed):
            code = "invalid_token"
        response = error_response(exc.status_code, code, str(exc.detail))
        if getattr(exc, "auth_header", None):
            response["WWW-Authenticate"] = exc.auth_header
        return response
    return None
