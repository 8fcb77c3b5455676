"""The one place where exceptions become the API's error JSON: DRF's exception handler, the hot
path's front doors, and Django's own handlers and views outside DRF all answer through here."""

from __future__ import annotations

import psycopg
from django.core.exceptions import RequestDataTooBig
from django.db import InterfaceError, OperationalError
from django.http import HttpResponse
from rest_framework import exceptions as drf

from core.errors import ApplicationError, DatabaseUnavailable, InvalidInput, PayloadTooLarge

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
    if isinstance(exc, RequestDataTooBig):
        return PayloadTooLarge("Request body exceeds the size limit.")
    if isinstance(exc, drf.ValidationError):
        return InvalidInput("Invalid input.", details=exc.detail)
    if isinstance(exc, drf.APIException):
        error = ApplicationError(str(exc.detail), code=DRF_CODES.get(type(exc), "bad_request"), status=exc.status_code)
        error.challenge = getattr(exc, "auth_header", None)  # DRF sets it on a 401
        return error
    return None


def error_response(error: ApplicationError) -> HttpResponse:
    response = HttpResponse(error.body(), status=error.status, content_type="application/json")
    for header, value in error.headers():
        response[header] = value
    return response


def exception_handler(exc, context):
    """DRF's EXCEPTION_HANDLER; None leaves a bug to Django (its 500, `handler500`)."""
    error = application_error(exc)
    return None if error is None else error_response(error)
