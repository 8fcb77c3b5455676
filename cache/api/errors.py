"""The one place where exceptions become the API's error JSON."""

from __future__ import annotations

from django.core.exceptions import RequestDataTooBig
from rest_framework import exceptions as drf
from rest_framework.response import Response

from cache.errors import ApplicationError

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


def error_response(status: int, code: str, message: str, details=None) -> Response:
    return Response({"error": {"code": code, "message": message, "details": details}}, status=status)


def exception_handler(exc, context):
    if isinstance(exc, ApplicationError):
        return error_response(exc.status, exc.code, exc.message, exc.details)
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
