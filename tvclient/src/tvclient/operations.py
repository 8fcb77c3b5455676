"""What each endpoint sends and how its answer is read, shared by the sync and async clients.

The clients only move an `Operation` over HTTP; everything about the REST contract lives here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from .errors import TVCacheError, TVCacheUnavailable
from .results import (
    Call,
    CallResult,
    LookupResult,
    RecordResult,
    SnapshotRegistration,
    ToolResult,
)
from .transport import Reply, retry_after_s

T = TypeVar("T")

API = "/api/v1"
# Load shed: the service (or a gateway) asks to come back later. Every 5xx is a failure too.
SHED = 429


@dataclass(frozen=True, slots=True)
class Operation(Generic[T]):
    method: str
    path: str
    parse: Callable[[Any], T]
    body: dict[str, Any] | None = None
    params: dict[str, Any] | None = None
    timed: bool = False  # the answer carries the service's own time (LookupResult.server_ms)
    raw: bool = False  # `parse` reads the answer's bytes, not JSON (an NDJSON export)


def _segment(value: str | int) -> str:
    # Task and rollout ids are the caller's strings; a "/" in one must not change the route.
    return quote(str(value), safe="")


def _without_none(**fields: Any) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if value is not None}


def _object(payload: Any) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise TypeError(f"expected a JSON object, got {type(payload).__name__}")
    return payload


def _object_or_empty(payload: Any) -> dict[str, Any]:
    return {} if payload is None else _object(payload)


def _nothing(payload: Any) -> None:
    return None


def _parse_with(result_type: Any) -> Callable[[Any], Any]:
    return lambda payload: result_type.from_json(_object(payload))


def _task_page(payload: Any) -> tuple[list[dict[str, Any]], int | None]:
    """A page of the task list and the offset of the next, None on the last page."""
    page = _object(payload)
    return list(page["tasks"]), page.get("next_offset")


def _task_path(task_id: str) -> str:
    return f"{API}/tasks/{_segment(task_id)}"


def put_task(
    task_id: str,
    env: Mapping[str, Any],
    tools: Mapping[str, Mapping[str, bool]] | None,
    sandbox_budget: int | None,
    audit_rate: float | None = None,
    match: str | None = None,
) -> Operation[dict[str, Any]]:
    body = _without_none(env=dict(env), tools=tools, sandbox_budget=sandbox_budget, audit_rate=audit_rate, match=match)
    return Operation("PUT", _task_path(task_id), _object, body=body)


def get_task(task_id: str) -> Operation[dict[str, Any]]:
    return Operation("GET", _task_path(task_id), _object)


def list_tasks(search: str | None, offset: int) -> Operation[tuple[list[dict[str, Any]], int | None]]:
    return Operation("GET", f"{API}/tasks", _task_page, params=_without_none(q=search, offset=offset or None))


def lookup(
    task_id: str,
    history: list[Call],
    call: Call,
    rollout_id: str | None,
    epoch: int | None,
    claim: bool = False,
    resume: bool = True,
    trace: Mapping[str, Any] | None = None,
) -> Operation[LookupResult]:
    body = _without_none(
        history=history,
        call=call,
        rollout_id=rollout_id,
        epoch=epoch,
        claim=claim or None,
        resume=None if resume else False,
        **(trace or {}),
    )
    return Operation("POST", f"{_task_path(task_id)}/lookup", _parse_with(LookupResult), body=body, timed=True)


def record(
    task_id: str,
    history: list[Call],
    call: Call,
    result: ToolResult,
    exec_ms: float,
    rollout_id: str | None,
    epoch: int | None,
    mutated: bool | None = None,
    file_times: Mapping[str, int] | None = None,
    replay: bool = False,
    trace: Mapping[str, Any] | None = None,
) -> Operation[RecordResult]:
    body = _without_none(
        history=history,
        call=call,
        result=result,
        exec_ms=exec_ms,
        rollout_id=rollout_id,
        epoch=epoch,
        mutated=mutated,
        file_times=dict(file_times) if file_times is not None else None,
        replay=True if replay else None,
        **(trace or {}),
    )
    return Operation("POST", f"{_task_path(task_id)}/record", _parse_with(RecordResult), body=body)


def register_snapshot(
    task_id: str,
    node_id: int,
    ref: str,
    backend: str,
    size_bytes: int | None,
    create_ms: float | None,
) -> Operation[SnapshotRegistration]:
    body = _without_none(ref=ref, backend=backend, size_bytes=size_bytes, create_ms=create_ms)
    path = f"{_task_path(task_id)}/nodes/{_segment(node_id)}/snapshots"
    return Operation("POST", path, _parse_with(SnapshotRegistration), body=body)


def report_audit(task_id: str, node_id: int, result: ToolResult, rollout_id: str | None) -> Operation[bool]:
    body = _without_none(result=result, rollout_id=rollout_id)
    return Operation(
        "POST",
        f"{_task_path(task_id)}/nodes/{_segment(node_id)}/audit",
        lambda payload: bool(_object(payload)["divergent"]),
        body=body,
    )


def release_lease(lease_id: int | str, restore_ms: float | None) -> Operation[None]:
    params = _without_none(restore_ms=restore_ms)
    return Operation("DELETE", f"{API}/leases/{_segment(lease_id)}", _nothing, params=params)


def release_claim(task_id: str, history: list[Call], call: Call, rollout_id: str) -> Operation[bool]:
    body = {"history": history, "call": call, "rollout_id": rollout_id}
    return Operation(
        "POST",
        f"{_task_path(task_id)}/claims/release",
        lambda payload: bool(_object(payload)["released"]),
        body=body,
    )


def replay_file_times(
    task_id: str, history: list[Call], call: Call, replay: list[Call]
) -> Operation[list[dict[str, int] | None]]:
    body = {"history": history, "call": call, "replay": replay}

    def parse(payload: Any) -> list[dict[str, int] | None]:
        times = [None if item is None else dict(_object(item)) for item in _object(payload)["file_times"]]
        if len(times) != len(replay):
            raise ValueError(f"{len(times)} file times for {len(replay)} replayed calls")
        return times

    return Operation("POST", f"{_task_path(task_id)}/file-times", parse, body=body)


def rollout_call(
    task_id: str, rollout_id: str, call: Call, epoch: int | None, trace: Mapping[str, Any] | None = None
) -> Operation[CallResult]:
    path = f"{_task_path(task_id)}/rollouts/{_segment(rollout_id)}/calls"
    body = _without_none(call=call, epoch=epoch, **(trace or {}))
    return Operation("POST", path, _parse_with(CallResult), body=body)


def branches(
    task_id: str,
    origin: Mapping[str, Any],
    count: int | None,
    rollout_ids: list[str] | None,
    epoch: int | None,
    tokens: Mapping[str, Any] | None,
    trajectory_refs: list[str] | None,
) -> Operation[dict[str, Any]]:
    body = _without_none(
        count=count,
        rollout_ids=rollout_ids,
        epoch=epoch,
        tokens=tokens,
        trajectory_refs=trajectory_refs,
    )
    return Operation("POST", f"{_task_path(task_id)}/branches", _object, body={"from": dict(origin), **body})


def tree_page(task_id: str, epoch: int | None, after: str | None, limit: int | None) -> Operation[list[bytes]]:
    params = _without_none(epoch=epoch, after=after, limit=limit)
    return Operation("GET", f"{_task_path(task_id)}/tree", bytes.splitlines, params=params or None, raw=True)


def end_rollout(task_id: str, rollout_id: str) -> Operation[None]:
    return Operation("DELETE", f"{_task_path(task_id)}/rollouts/{_segment(rollout_id)}", _nothing)


def announce_step(tasks: list[str], rollouts_per_task: int, epoch: int) -> Operation[dict[str, Any]]:
    body = {"tasks": list(tasks), "rollouts_per_task": rollouts_per_task, "epoch": epoch}
    return Operation("POST", f"{API}/steps", _object_or_empty, body=body)


def graph(task_id: str, after: str | None = None, limit: int | None = None) -> Operation[dict[str, Any]]:
    params = _without_none(after=after, limit=limit)
    return Operation("GET", f"{_task_path(task_id)}/graph", _object, params=params or None)


def stats(task_id: str) -> Operation[dict[str, Any]]:
    return Operation("GET", f"{_task_path(task_id)}/stats", _object)


def pools(offset: int = 0, limit: int | None = None) -> Operation[dict[str, Any]]:
    """One page of the project's tasks holding sandboxes or snapshots (`next_offset` for the next)."""
    return Operation("GET", f"{API}/pools", _object, params=_without_none(offset=offset or None, limit=limit) or None)


def sandboxes(task_id: str) -> Operation[dict[str, Any]]:
    return Operation("GET", f"{_task_path(task_id)}/sandboxes", _object)


def read_response(operation: Operation[T], reply: Reply) -> T:
    """The operation's typed answer, or the service's error raised as a TVCacheError."""
    if reply.status >= 400:
        raise error_from_response(reply)
    try:
        payload = reply.content if operation.raw else json.loads(reply.content) if reply.content else None
        result = operation.parse(payload)
    except (KeyError, TypeError, ValueError) as exc:
        raise TVCacheError(
            reply.status,
            "bad_response",
            f"unexpected answer to {operation.method} {operation.path}: {exc!r}",
            _text(reply)[:2000],
        ) from exc
    return replace(result, server_ms=reply.server_ms) if operation.timed else result


def error_from_response(reply: Reply) -> TVCacheError:
    try:
        error = json.loads(reply.content)["error"]
        code, message, details = str(error["code"]), str(error["message"]), error.get("details")
    except (KeyError, TypeError, ValueError):
        # Not the service's error JSON: a proxy's page or a crash before the error handler ran.
        code, message, details = f"http_{reply.status}", _text(reply)[:500] or reply.reason, None
    if reply.status == SHED or reply.status >= 500:
        return TVCacheUnavailable(reply.status, code, message, details, retry_after_s(reply.retry_after))
    return TVCacheError(reply.status, code, message, details)


def _text(reply: Reply) -> str:
    return reply.content.decode("utf-8", errors="replace")


def unavailable(operation: Operation[Any], exc: Exception) -> TVCacheUnavailable:
    return TVCacheUnavailable(
        None,
        "unavailable",
        f"{operation.method} {operation.path} failed: {exc!r}",
        {"exception": type(exc).__name__},
    )
