"""Trainer-facing API v1: one view per operation; validate, call one service or selector, serialize."""

from __future__ import annotations

import orjson
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import status
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.projects import task_public_id
from cache import selectors, services
from cache.inputs import (
    MAX_MS,
    parse_claim_release,
    parse_file_times_query,
    parse_lookup,
    parse_node_id,
    parse_record,
    parse_task,
)
from cache.services.trees import DEFAULT_LIMIT as DEFAULT_TREE_PAGE
from cache.services.trees import MAX_LIMIT as MAX_TREE_PAGE
from cache.tcg import RecordedState
from core.api.rendering import ndjson_streamed
from core.errors import InvalidInput
from core.inputs import INT32, INT64, check_json, parse_id, parse_query_int
from observability import metrics

from . import serializers as s
from .frontdoor import FrontDoorView

ERRORS = {code: s.ErrorSerializer for code in (400, 401, 403, 404, 409, 413, 429, 503)}
TASK_PAGE = 100  # tasks per answer of the task list unless ?limit= says otherwise
TASK_PAGE_MAX = 1000


def _valid(serializer_class, data):
    serializer = serializer_class(data=data)
    if not serializer.is_valid():
        raise ValidationError(serializer.errors)
    return serializer.validated_data


def taskjson_response(task) -> dict:
    return s.TaskSerializer(task).data


def task_key(request, task_id: str) -> str:
    """The internal key of the caller's project's task `task_id` (accounts.projects): every route
    resolves a task here, once, so another project's task is never reached (it answers 404)."""
    return request.user.task_key(task_id)


class TaskListView(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("q", str, description="task id contains (any case)"),
            OpenApiParameter("limit", int, description=f"1 to {TASK_PAGE_MAX}, default {TASK_PAGE}"),
            OpenApiParameter("offset", int),
        ],
        responses={200: s.TaskListSerializer, 400: s.ErrorSerializer, 401: s.ErrorSerializer},
        operation_id="v1_tasks_list",
        summary="List tasks with their totals, a page at a time (by id)",
    )
    def get(self, request):
        limit = parse_query_int(request.query_params, "limit", TASK_PAGE, low=1, high=TASK_PAGE_MAX)
        offset = parse_query_int(request.query_params, "offset", 0, low=0, high=INT32[1])
        search = request.query_params.get("q", "")
        check_json(search, "q")
        ids = selectors.task_ids(project_id=request.user.project_id, search=search.strip())
        count = ids.count()
        rows = selectors.task_list_stats(task_ids=list(ids[offset : offset + limit]))
        return Response(
            {
                "tasks": [
                    {
                        **taskjson_response(r["task"]),
                        "stats": r["stats"],
                        "nodes": r["nodes"],
                        "live_snapshots": r["live_snapshots"],
                    }
                    for r in rows
                ],
                "count": count,
                "next_offset": offset + limit if offset + limit < count else None,
            }
        )


class TaskView(APIView):
    @extend_schema(
        request=s.TaskPutSerializer,
        responses={200: s.TaskSerializer, 201: s.TaskSerializer, **ERRORS},
        summary="Create or update a task",
    )
    def put(self, request, task_id: str):
        key = task_key(request, parse_id(task_id, "task_id"))
        spec = parse_task(request.data)
        task, created = services.task_put(
            task_id=key,
            env=spec.env,
            tools=spec.tools,
            sandbox_budget=spec.sandbox_budget,
            audit_rate=spec.audit_rate,
            retention=spec.retention,
            match=spec.match,
            actor=request.user,
        )
        return Response(taskjson_response(task), status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(responses={200: s.TaskSerializer, **ERRORS}, summary="A task with its stats")
    def get(self, request, task_id: str):
        key = task_key(request, task_id)
        task = selectors.task_get(task_id=key)
        return Response({**taskjson_response(task), "stats": selectors.task_stats(task_id=key)})


class TaskStatsView(APIView):
    @extend_schema(
        responses={200: dict, **ERRORS},
        summary="Calls, hits, hit rate, oracle hit rate, executed and saved ms; per epoch and per tool",
    )
    def get(self, request, task_id: str):
        key = task_key(request, task_id)
        selectors.task_get(task_id=key)
        return Response(selectors.task_stats(task_id=key))


# Request examples: the API docs show them, and schemathesis's examples phase sends them.
_CLONE = {"tool": "bash", "args": {"command": "git clone /src/repo /repo"}}
_TEST = {"tool": "bash", "args": {"command": "cd /repo && make test", "timeout_s": 600}}


def _hit_body(hit) -> bytes:
    # The stored result is canonical JSON already: splice it in rather than re-encode it.
    return b'{"hit":true,"node_id":%d,"mutates":%s,%s"result":%s}' % (
        hit.node_id,
        b"true" if hit.mutates else b"false",
        b'"audit":true,' if hit.audit else b"",
        hit.result_json.encode(),
    )


@extend_schema_view(
    post=extend_schema(
        request=s.LookupSerializer,
        responses={200: s.LookupResponseSerializer, **ERRORS},
        summary="Lookup of a call after a history (longest prefix; also by state where the task matches by state)",
        examples=[
            OpenApiExample(
                "The second call of a rollout",
                request_only=True,
                value={"history": [_CLONE], "call": _TEST, "rollout_id": "step-3-rollout-5", "epoch": 1},
            )
        ],
    )
)
class LookupView(FrontDoorView):
    route = "/api/v1/tasks/{task_id}/lookup"

    @staticmethod
    @metrics.lookup_timed
    def answer_in_memory(*, principal, task_id: str, payload, admit) -> bytes | None:
        query = parse_lookup(payload)
        hit = services.tcg_lookup_in_memory(task_id=principal.task_key(task_id), context=query.context, admit=admit)
        return None if hit is None else _hit_body(hit)

    @staticmethod
    @metrics.lookup_timed
    def answer(*, principal, task_id: str, payload) -> bytes:
        query = parse_lookup(payload)
        answer = services.tcg_lookup(
            task_id=principal.task_key(task_id), context=query.context, claim=query.claim, resume=query.resume
        )
        if isinstance(answer, services.LookupHit):
            return _hit_body(answer)
        match = answer.match
        resume = None
        if match.resume is not None:
            resume = {
                "node_id": match.resume.node_id,
                "snapshot_id": match.resume.snapshot_id,
                "snapshot_ref": match.resume.snapshot_ref,
                "lease_id": answer.lease_id,
                "replay": match.replay,
            }
        # orjson writes a ToolCall dataclass as {"tool", "args"}, field order: what to_json() gives.
        body = {
            "hit": False,
            "matched": match.matched,
            "resume": resume,
            "replay": answer.full_replay,
            "snapshot_after_ms": answer.snapshot_after_ms,
        }
        if answer.claim is not None:
            body["claim"] = answer.claim
        return orjson.dumps(body)


@extend_schema_view(
    post=extend_schema(
        request=s.RecordSerializer,
        responses={200: s.RecordResponseSerializer, **ERRORS},
        summary="Record a call's result (idempotent)",
        examples=[
            OpenApiExample(
                "The result of a miss, executed by the client",
                request_only=True,
                value={
                    "history": [_CLONE],
                    "call": _TEST,
                    "rollout_id": "step-3-rollout-5",
                    "epoch": 1,
                    "result": {"stdout": "4 passed\n", "stderr": "", "exit_code": 0, "timed_out": False},
                    "exec_ms": 8250.0,
                },
            )
        ],
    )
)
class RecordView(FrontDoorView):
    route = "/api/v1/tasks/{task_id}/record"
    lane = "write"

    @staticmethod
    def answer(*, principal, task_id: str, payload) -> bytes:
        record = parse_record(payload)
        outcome = services.node_record(
            task_id=principal.task_key(task_id), record=record, state=RecordedState(file_times=record.file_times)
        )
        return orjson.dumps(
            {
                "node_id": outcome.node_id,
                "created": outcome.created,
                "mutates": outcome.mutates,
                "snapshot": "wanted" if outcome.snapshot_wanted else "skipped",
                "evicted": outcome.evicted,
            }
        )


class ClaimReleaseView(APIView):
    @extend_schema(
        request=s.ClaimReleaseSerializer,
        responses={200: s.ClaimReleasedSerializer, **ERRORS},
        summary="Give up a claim taken by a lookup (the call's execution failed): the next rollout executes it",
    )
    def post(self, request, task_id: str):
        context = parse_claim_release(request.data)
        return Response({"released": services.claim_release(task_id=task_key(request, task_id), context=context)})


class FileTimesView(APIView):
    @extend_schema(
        request=s.FileTimesQuerySerializer,
        responses={200: s.FileTimesSerializer, **ERRORS},
        summary="The file times a client writes back after each call of a replay (the live run's)",
    )
    def post(self, request, task_id: str):
        query = parse_file_times_query(request.data)
        key = task_key(request, task_id)
        selectors.task_get(task_id=key)
        times = services.replay_file_times(task_id=key, context=query.context, calls=query.replay)
        return Response({"file_times": times})


class SnapshotRegisterView(APIView):
    @extend_schema(
        request=s.SnapshotRegisterSerializer,
        responses={201: s.SnapshotRegisteredSerializer, **ERRORS},
        summary="Register a snapshot a client took after 'snapshot: wanted'",
    )
    def post(self, request, task_id: str, node_id: int):
        data = _valid(s.SnapshotRegisterSerializer, request.data)
        parse_node_id(node_id)
        key = task_key(request, task_id)
        selectors.task_get(task_id=key)
        snapshot, evicted = services.snapshot_register(task_id=key, node_id=node_id, **data)
        return Response(
            {"snapshot_id": snapshot.pk, "ref": snapshot.ref, "evicted": evicted}, status=status.HTTP_201_CREATED
        )


class NodeAuditView(APIView):
    @extend_schema(
        request=s.NodeAuditSerializer,
        responses={200: s.NodeAuditedSerializer, **ERRORS},
        summary="Report a client's re-execution of a hit (determinism audit); a differing result "
        "makes the node divergent: it is no longer served",
    )
    def post(self, request, task_id: str, node_id: int):
        data = _valid(s.NodeAuditSerializer, request.data)
        parse_node_id(node_id)
        divergent = services.node_audit(
            task_id=task_key(request, task_id),
            node_id=node_id,
            result=data["result"],
            rollout_id=data.get("rollout_id", ""),
        )
        return Response({"divergent": divergent})


class LeaseView(APIView):
    @extend_schema(
        parameters=[OpenApiParameter("restore_ms", float, description="Time the fork from the snapshot took")],
        responses={204: None, **ERRORS},
        summary="Release a lease",
    )
    def delete(self, request, lease_id: str):
        restore_ms = request.query_params.get("restore_ms")
        try:
            restore_ms = float(restore_ms) if restore_ms is not None else None
        except ValueError:
            restore_ms = -1.0
        if restore_ms is not None and not 0 <= restore_ms <= MAX_MS:  # nan and inf too
            raise InvalidInput(
                f"'restore_ms' must be a number from 0 to {MAX_MS:.0f}.",
                details={"field": "restore_ms", "min": 0, "max": MAX_MS},
            )
        services.lease_release(lease_id=lease_id, restore_ms=restore_ms, project=request.user.project)
        return Response(status=status.HTTP_204_NO_CONTENT)


class GraphView(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("root", int),
            OpenApiParameter("depth", int),
            OpenApiParameter("limit", int, description=f"nodes per page (default and at most {selectors.GRAPH_PAGE})"),
            OpenApiParameter("after", str, description="the previous page's `next`"),
        ],
        responses={200: dict, **ERRORS},
        summary="Nodes and edges of the task's tool call graph (optionally a subtree), a page at a time",
    )
    def get(self, request, task_id: str):
        params = request.query_params
        root = parse_query_int(params, "root", None, low=1, high=INT64[1])
        depth = parse_query_int(params, "depth", None, low=0, high=INT32[1])
        limit = parse_query_int(params, "limit", selectors.GRAPH_PAGE, low=1, high=selectors.GRAPH_PAGE)
        graph = selectors.graph_export(
            task_id=task_key(request, task_id),
            root=root,
            max_depth=depth,
            limit=limit,
            after=selectors.graph_cursor(params.get("after")),
        )
        return Response({**graph, "task_id": task_public_id(graph["task_id"])})


class TreeView(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("epoch", int, description="only the rollouts of this epoch"),
            OpenApiParameter("after", str, description="the `next` cursor of the previous page"),
            OpenApiParameter("limit", int, description=f"rollouts per page (default {DEFAULT_TREE_PAGE})"),
        ],
        responses={(200, "application/x-ndjson"): str, **ERRORS},
        summary="Rollout tree export (NDJSON, streamed): each rollout's path, branch origin and token spans",
    )
    def get(self, request, task_id: str):
        params = request.query_params
        epoch = parse_query_int(params, "epoch", None, low=INT32[0], high=INT32[1])
        after = parse_query_int(params, "after", 0, low=0, high=INT64[1])
        limit = parse_query_int(params, "limit", DEFAULT_TREE_PAGE, low=1, high=MAX_TREE_PAGE)
        key = task_key(request, task_id)
        selectors.task_get(task_id=key)
        return ndjson_streamed(services.tree_export(task_id=key, epoch=epoch, after=after, limit=limit))


# Maintainer actions (the role is checked after the task and node are found: another project's
# task or node is a 404 to every role). Each is written to the audit log with the token's name, refusals too.
class TaskFlushView(APIView):
    @extend_schema(
        request=None,
        responses={200: s.AuditedSerializer, **ERRORS},
        summary="Maintainers: drop every node, snapshot, rollout and counter of the task (audited)",
    )
    def post(self, request, task_id: str):
        key = task_key(request, task_id)
        selectors.task_get(task_id=key)
        return Response(s.audited_json(services.admin_task_flush(actor=request.user, task_id=key)))


class NodeEvictView(APIView):
    @extend_schema(
        request=s.NodeEvictSerializer,
        responses={200: s.AuditedSerializer, **ERRORS},
        summary="Maintainers: evict a node's snapshot, or its whole subtree (audited)",
    )
    def post(self, request, task_id: str, node_id: int):
        data = _valid(s.NodeEvictSerializer, request.data)
        parse_node_id(node_id)
        key = task_key(request, task_id)
        selectors.node_check(task_id=key, node_id=node_id)
        evict = services.admin_subtree_evict if data["subtree"] else services.admin_snapshot_evict
        return Response(s.audited_json(evict(actor=request.user, task_id=key, node_id=node_id)))


class NodePinView(APIView):
    @extend_schema(
        request=s.NodePinSerializer,
        responses={200: s.AuditedSerializer, **ERRORS},
        summary="Maintainers: pin a node (its snapshot is never evicted by the budget) or unpin it (audited)",
    )
    def put(self, request, task_id: str, node_id: int):
        data = _valid(s.NodePinSerializer, request.data)
        parse_node_id(node_id)
        key = task_key(request, task_id)
        selectors.node_check(task_id=key, node_id=node_id)
        return Response(
            s.audited_json(
                services.admin_node_pin(actor=request.user, task_id=key, node_id=node_id, pinned=data["pinned"])
            )
        )
