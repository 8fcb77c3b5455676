"""Sandbox REST API v1: tool-server mode, step announcements, pools and a task's sandboxes."""

from __future__ import annotations

import orjson
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.projects import task_public_id
from cache.api.frontdoor import FrontDoorView
from cache.api.serializers import ErrorSerializer, PromptSpanSerializer, ToolCallSerializer, TraceSerializer
from cache.inputs import MAX_BRANCHES, MAX_TRAJECTORY_REF, parse_branch, parse_rollout_call
from core.inputs import INT32, parse_id, parse_query_int
from core.lanes import HandBack
from observability import metrics
from sandboxes import selectors, services
from sandboxes.models import Sandbox

ERRORS = {code: ErrorSerializer for code in (400, 401, 403, 404, 409, 429, 503)}
POOL_PAGE = 50  # tasks per answer of GET /pools unless ?limit= says otherwise
POOL_PAGE_MAX = 500


class CallSerializer(TraceSerializer):
    call = ToolCallSerializer()
    epoch = serializers.IntegerField(required=False, default=0, min_value=INT32[0], max_value=INT32[1])


class CallResultSerializer(serializers.Serializer):
    result = serializers.JSONField()
    cached = serializers.BooleanField()
    node_id = serializers.IntegerField(allow_null=True, help_text="null when the result was not cached (a timeout)")
    latency_ms = serializers.FloatField()
    phases_ms = serializers.DictField(
        child=serializers.FloatField(),
        help_text=(
            "where the call's time went: lanes (the service's queues before the run that answered), claim (the "
            "rollout's, and its release), lookup, wait (for another rollout executing the same call), background_wait "
            "(for work on the rollout's sandbox after its previous answer), snapshot_wait (for a snapshot to fork rather "
            "than replay), prepare (a miss's bookkeeping before its call runs), materialize, replay, verify, exec, "
            "fingerprint, record, snapshot"
        ),
    )
    mutates = serializers.BooleanField(
        help_text="The call changed the rollout's state. False for a read-only tool, "
        "and for a call the sandbox observed to change nothing."
    )


class BranchFromSerializer(serializers.Serializer):
    rollout = serializers.CharField(required=False, help_text="with `step`: branch rollout R after k calls")
    step = serializers.IntegerField(
        required=False, min_value=0, max_value=INT32[1], help_text="calls of R's history (its state-changing calls)"
    )
    node_id = serializers.IntegerField(required=False, min_value=1, help_text="or: branch at a recorded node")


class BranchSerializer(serializers.Serializer):
    from_ = BranchFromSerializer(help_text='{"rollout": R, "step": k} or {"node_id": N}')
    count = serializers.IntegerField(min_value=1, max_value=MAX_BRANCHES, required=False)
    rollout_ids = serializers.ListField(
        child=serializers.CharField(), required=False, help_text="the new rollouts' ids (default: made up)"
    )
    epoch = serializers.IntegerField(required=False, default=0, min_value=INT32[0], max_value=INT32[1])
    tokens = PromptSpanSerializer(required=False, help_text="what each branch shares of its origin's tokens")
    trajectory_refs = serializers.ListField(
        child=serializers.CharField(max_length=MAX_TRAJECTORY_REF),
        required=False,
        help_text="the trainer's reference of each branch's trajectory (opaque), one per branch",
    )

    def get_fields(self):
        fields = super().get_fields()
        fields["from"] = fields.pop("from_")
        return fields


class BranchOpenedSerializer(serializers.Serializer):
    rollout_id = serializers.CharField()
    ready_ms = serializers.FloatField(
        allow_null=True,
        help_text="until its sandbox was in the branch point's state (null: none made before the answer)",
    )
    materialized = serializers.CharField(
        help_text="how: prefork, fork, checkpoint, root, own, rebuilt; on_miss: none was made before the answer, "
        "the branch's first miss makes it as any miss does; empty in client mode",
    )


class BranchesSerializer(serializers.Serializer):
    node_id = serializers.IntegerField(allow_null=True, help_text="the node whose state the branches start in")
    history = ToolCallSerializer(many=True, help_text="each branch's history: its calls continue after these")
    branches = BranchOpenedSerializer(many=True)


class StepSerializer(serializers.Serializer):
    tasks = serializers.ListField(child=serializers.SlugField(), max_length=10_000)
    rollouts_per_task = serializers.IntegerField(min_value=1, max_value=256)
    epoch = serializers.IntegerField(required=False, default=0)


class LiveSandboxSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    backend = serializers.CharField()
    pool = serializers.ChoiceField(choices=Sandbox.Pool.choices)
    state = serializers.ChoiceField(choices=Sandbox.State.choices)
    rollout_id = serializers.CharField(allow_null=True, help_text="the rollout it serves; null while in a pool")
    ref = serializers.CharField(
        allow_blank=True, help_text="the backend's id of it (a container id); empty while it starts"
    )


class TaskSandboxesSerializer(serializers.Serializer):
    started = serializers.IntegerField(
        help_text="sandboxes the service started or forked for the task, stopped ones included"
    )
    live = LiveSandboxSerializer(many=True, help_text="those not stopped, oldest first")


@extend_schema_view(
    post=extend_schema(
        request=CallSerializer,
        responses={200: CallResultSerializer, **ERRORS},
        summary="Tool-server mode: run a rollout's next call (answered from the cache when it can be)",
    )
)
class RolloutCallView(FrontDoorView):
    route = "/api/v1/tasks/{task_id}/rollouts/{rollout_id}/calls"
    lane = "tool"  # a miss executes the tool

    @classmethod
    def first_lane(cls, path_kwargs: dict[str, str]) -> str:
        # A rollout whose last call ran its tool most likely misses again (it is in a state no other
        # rollout reached yet): it starts where a miss runs rather than look up on the hits' lane
        # first and again there (docs/design/hot-path.md). A hit there is answered as anywhere.
        ran = services.rollout_ran_last(task_id=path_kwargs["task_id"], rollout_id=path_kwargs["rollout_id"])
        return "exec" if ran else cls.lane

    @staticmethod
    def answer(*, principal, task_id: str, rollout_id: str, payload) -> bytes:
        parsed = parse_rollout_call(payload)
        outcome = services.rollout_call(
            task_id=principal.task_key(task_id),
            rollout_id=parse_id(rollout_id, "rollout_id"),
            call=parsed.call,
            epoch=parsed.epoch,
            trace=parsed.trace,
        )
        if isinstance(outcome, HandBack):  # on the front door's lane: it goes on elsewhere (core/lanes.py)
            return outcome
        services.rollout_ran_note(task_id=task_id, rollout_id=rollout_id, ran=not outcome.cached)
        metrics.tool_call_observed(tool=parsed.call.tool, cached=outcome.cached, ms=outcome.latency_ms)
        return orjson.dumps(
            {
                "result": outcome.result,
                "cached": outcome.cached,
                "node_id": outcome.node_id,
                "latency_ms": round(outcome.latency_ms, 3),
                "mutates": outcome.mutates,
                "phases_ms": {k: round(v, 3) for k, v in outcome.phases_ms.items()},
            }
        )


class BranchesView(APIView):
    @extend_schema(
        request=BranchSerializer,
        responses={201: BranchesSerializer, **ERRORS},
        summary="Branch: start rollouts at a rollout's step or a recorded node, each with a sandbox in its state",
    )
    def post(self, request, task_id: str):
        spec = parse_branch(request.data)
        opened = services.branches_open(
            task_id=request.user.task_key(task_id),
            rollout=spec.rollout,
            step=spec.step,
            node_id=spec.node_id,
            count=spec.count,
            rollout_ids=spec.rollout_ids,
            epoch=spec.epoch,
            tokens=spec.tokens,
            trajectory_refs=spec.trajectory_refs,
        )
        body = {
            "node_id": opened.point.node_id,
            "history": [call.to_json() for call in opened.point.history],
            "branches": [
                {"rollout_id": b.rollout_id, "ready_ms": b.ready_ms and round(b.ready_ms, 3), "materialized": b.how}
                for b in opened.branches
            ],
        }
        return Response(body, status=status.HTTP_201_CREATED)


class RolloutView(APIView):
    @extend_schema(responses={204: None, **ERRORS}, summary="End a rollout and free its sandbox")
    def delete(self, request, task_id: str, rollout_id: str):
        services.rollout_end(task_id=request.user.task_key(task_id), rollout_id=rollout_id)
        services.rollout_ran_note(task_id=task_id, rollout_id=rollout_id, ran=False)
        return Response(status=status.HTTP_204_NO_CONTENT)


class StepsView(APIView):
    @extend_schema(
        request=StepSerializer,
        responses={202: dict, **ERRORS},
        summary="Announce a training step: warm root sandboxes and pre-fork hot snapshots",
    )
    def post(self, request):
        serializer = StepSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        planned = services.step_announce(
            task_ids=[request.user.task_key(t) for t in data["tasks"]], rollouts_per_task=data["rollouts_per_task"]
        )
        return Response(
            {"planned": {task_public_id(key): plan for key, plan in planned.items()}}, status=status.HTTP_202_ACCEPTED
        )


class TaskSandboxesView(APIView):
    @extend_schema(
        responses={200: TaskSandboxesSerializer, **ERRORS},
        summary="A task's sandboxes: how many the service started, and those alive now with their rollouts",
    )
    def get(self, request, task_id: str):
        return Response(selectors.task_sandboxes(task_id=request.user.task_key(task_id)))


class PoolsView(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("limit", int, description=f"tasks per page, 1 to {POOL_PAGE_MAX}, default {POOL_PAGE}"),
            OpenApiParameter("offset", int),
        ],
        responses={200: dict, **ERRORS},
        summary="The project's tasks holding sandboxes or live snapshots, a page at a time, one row each;"
        " totals, fork latency, engine health",
    )
    def get(self, request):
        limit = parse_query_int(request.query_params, "limit", POOL_PAGE, low=1, high=POOL_PAGE_MAX)
        offset = parse_query_int(request.query_params, "offset", 0, low=0, high=INT32[1])
        return Response(selectors.pools_listed(project_id=request.user.project_id, limit=limit, offset=offset))
