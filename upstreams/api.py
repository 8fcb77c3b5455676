"""Upstreams API v1 (token-authenticated), and the verl-tool proxy path (its secret is the
credential: verl-tool trainers send no Authorization header)."""

from __future__ import annotations

import orjson
from django.http import HttpResponseNotAllowed
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from cache.api.frontdoor import json_response
from cache.api.serializers import ErrorSerializer
from core.api.errors import application_error, error_response
from core.errors import InvalidInput
from upstreams import selectors, services

ERRORS = {code: ErrorSerializer for code in (400, 401, 404)}


class UpstreamPutSerializer(serializers.Serializer):
    protocol = serializers.ChoiceField(choices=["verl-tool"])
    url = serializers.URLField(help_text="The upstream tool server's endpoint, e.g. http://host:5000/get_observation")
    task_fields = serializers.ListField(
        child=serializers.CharField(),
        help_text=("Extra fields whose values name the task (the tool call graph shared by its trajectories)"),
    )
    action_pattern = serializers.CharField(
        required=False,
        allow_null=True,
        help_text=(
            "Regular expression (Python, '.' matches newlines): the call is its first group's match in the action, "
            "or the whole match; an action it does not match passes through uncached. Default: the whole action"
        ),
    )
    read_only = serializers.BooleanField(
        required=False, default=False, help_text=("The upstream's actions never change its state (mutates_state false)")
    )
    ignore_fields = serializers.ListField(
        child=serializers.CharField(),
        required=False,
        help_text=("Extra fields left out of the call (still sent to the upstream). Default: none"),
    )
    timeout_s = serializers.FloatField(required=False, help_text="Per upstream request; default 120")
    rotate_secret = serializers.BooleanField(
        required=False, help_text="Make a new proxy path; the old one stops working"
    )


class UpstreamSerializer(serializers.Serializer):
    name = serializers.CharField()
    protocol = serializers.CharField()
    url = serializers.CharField()
    task_fields = serializers.ListField(child=serializers.CharField())
    action_pattern = serializers.CharField()
    read_only = serializers.BooleanField()
    ignore_fields = serializers.ListField(child=serializers.CharField())
    timeout_s = serializers.FloatField()
    proxy_path = serializers.CharField(help_text="Path of the proxy under the service; it carries a secret")
    proxy_url = serializers.CharField(
        help_text=(
            "The proxy's URL as this request reached the service: the trainer's actor_rollout_ref.agent.tool_server_url"
        )
    )
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()


class UpstreamStatsSerializer(UpstreamSerializer):
    hits = serializers.IntegerField(help_text="Actions answered from the tool call graph")
    misses = serializers.IntegerField(help_text="Actions looked up, not found and sent to the upstream")
    passed_through = serializers.IntegerField(
        help_text=("Actions sent as they are: finish, pattern mismatch, trajectories off the shared graph")
    )
    upstream_requests = serializers.IntegerField(help_text="HTTP requests sent to the upstream, catch-up included")
    upstream_errors = serializers.IntegerField(help_text="Upstream requests that got no verl-tool answer")
    trajectories = serializers.IntegerField()


def upstream_json(request, upstream) -> dict:
    path = services.proxy_path(upstream)
    fields = (
        "name",
        "protocol",
        "url",
        "task_fields",
        "action_pattern",
        "read_only",
        "ignore_fields",
        "timeout_s",
        "created_at",
        "updated_at",
    )
    return UpstreamSerializer(
        {**{f: getattr(upstream, f) for f in fields}, "proxy_path": path, "proxy_url": request.build_absolute_uri(path)}
    ).data


class UpstreamView(APIView):
    @extend_schema(
        request=UpstreamPutSerializer,
        responses={200: UpstreamSerializer, 201: UpstreamSerializer, **ERRORS},
        operation_id="v1_upstreams_put",
        summary="Register (or update) an upstream tool server; the answer has the proxy URL for trainers",
    )
    def put(self, request, name: str):
        selectors.upstream_for(principal=request.user, name=name, write=True)
        upstream, created = services.upstream_put(project_id=request.user.project_id, name=name, data=request.data)
        return Response(
            upstream_json(request, upstream), status=status.HTTP_201_CREATED if created else status.HTTP_200_OK
        )

    @extend_schema(
        responses={200: UpstreamStatsSerializer, **ERRORS},
        operation_id="v1_upstreams_get",
        summary="An upstream's configuration, proxy URL and counters",
    )
    def get(self, request, name: str):
        upstream = selectors.upstream_get(principal=request.user, name=name)
        return Response({**upstream_json(request, upstream), **selectors.upstream_stats(upstream=upstream)})


@csrf_exempt
def verl_tool_observations(request, secret: str):
    """POST <proxy path>: verl-tool's get_observation, answered through the cache."""
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    try:
        try:
            payload = orjson.loads(request.body)
        except orjson.JSONDecodeError as exc:
            raise InvalidInput(f"Malformed JSON: {exc}", code="malformed_json") from None
        return json_response(orjson.dumps(services.observations_serve(secret=secret, payload=payload)))
    except Exception as exc:
        error = application_error(exc)
        if error is None:
            raise
        return error_response(error)
