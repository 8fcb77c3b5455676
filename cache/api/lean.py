"""A DRF view for the hot endpoints whose dispatch skips DRF's per-request machinery.

Lookup and record run at thousands of requests per second; content negotiation, parser and
renderer selection, permission and throttle classes cost more than the lookup itself. These
views check the token and parse the JSON body themselves, and answer errors in the same JSON
shape as the exception handler. The OpenAPI schema still describes them like any DRF view.
"""

from __future__ import annotations

import orjson
from django.core.exceptions import RequestDataTooBig
from django.http import HttpResponse
from rest_framework.views import APIView

from cache.errors import ApplicationError

from .auth import trainer_for_key


def json_response(payload: bytes, status: int = 200) -> HttpResponse:
    return HttpResponse(payload, status=status, content_type="application/json")


def error_response(status: int, code: str, message: str, details=None) -> HttpResponse:
    body = {"error": {"code": code, "message": message, "details": details}}
    response = json_response(orjson.dumps(body), status)
    if status == 401:
        response["WWW-Authenticate"] = "Token"
    return response


class LeanPostView(APIView):
    def dispatch(self, request, *args, **kwargs):
        if request.method != "POST":
            return super().dispatch(request, *args, **kwargs)
        self.args, self.kwargs, self.request = args, kwargs, request
        parts = request.META.get("HTTP_AUTHORIZATION", "").split()
        if not parts or parts[0].lower() != "token":
            return error_response(401, "not_authenticated", "Authentication credentials were not provided.")
        if len(parts) != 2 or trainer_for_key(parts[1]) is None:
            return error_response(401, "invalid_token", "Invalid or revoked token.")
        try:
            self.payload = orjson.loads(request.body)
        except orjson.JSONDecodeError as exc:
            return error_response(400, "malformed_json", f"Malformed JSON: {exc}")
        except RequestDataTooBig:
            return error_response(413, "payload_too_large", "Request body exceeds the size limit.")
        try:
            return self.post(request, *args, **kwargs)
        except ApplicationError as exc:
            return error_response(exc.status, exc.code, exc.message, exc.details)
