"""What an upstream's request item is in the tool call graph: its task and its call.

The task is named by the values of the upstream's `task_fields` in the item's extra fields; its
env is `{"backend": "external", "upstream": name, "task": {field: value}, "call": {...}}`, where
"call" holds what shapes the calls (the pattern and the ignored fields), so that a changed one
gives the task a new fingerprint and drops the graph made under the old one.

The call is `{"tool": "action", "args": {"action": <the action reduced by the pattern>,
"extra": <the extra fields the tool sees, less the task's and the ignored ones>}}`. An item the
pattern does not match, or that the upstream answered invalid, is recorded as a `passthrough`
call of the raw action: never served, but part of the history when the upstream's actions
change state (verl-tool's tools keep even an invalid action in a trajectory's env), so that no
result of the trajectory is filed under a state it did not have."""

from __future__ import annotations

import functools
import hashlib
import re
import threading

from django.db import IntegrityError

from accounts.projects import task_key
from cache.models import Task
from cache.services import TaskHandle, task_handle, task_put
from cache.tcg import ToolCall, canonical_json
from core.errors import NotFound
from upstreams.models import Upstream

from .protocol import ActionItem

ACTION, PASSTHROUGH = "action", "passthrough"
MAX_KNOWN_TASKS = 10_000
_known: dict[str, bytes] = {}  # task id -> the spec this process last made sure the task has
_known_lock = threading.Lock()


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> re.Pattern:
    # A model's action spans lines: "." matches newlines too.
    return re.compile(pattern, re.DOTALL)


def task_values(upstream: Upstream, item: ActionItem) -> dict | None:
    """The task fields' values in the item's extra fields; None if it carries none of them."""
    extra = item.extra_fields or {}
    if upstream.task_fields and not any(field in extra for field in upstream.task_fields):
        return None
    return {field: extra.get(field) for field in upstream.task_fields}


def task_id_for(upstream: Upstream, values: dict) -> str:
    """The key of the task the values name, in the upstream's project (accounts.projects.task_key)."""
    return task_key(
        upstream.project.name, f"{upstream.name}--{hashlib.sha256(canonical_json(values)).hexdigest()[:24]}"
    )


def _spec(upstream: Upstream, values: dict) -> tuple[dict, dict]:
    env = {
        "backend": "external",
        "upstream": upstream.name,
        "task": values,
        "call": {"action_pattern": upstream.action_pattern, "ignore_fields": sorted(upstream.ignore_fields)},
    }
    writes = not upstream.read_only
    tools = {
        ACTION: {"mutates_state": writes, "cacheable": True},
        PASSTHROUGH: {"mutates_state": writes, "cacheable": False},
    }
    return env, tools


def task_ensure(*, upstream: Upstream, values: dict, fresh: bool = False) -> TaskHandle:
    """The task the values name, created on first sight and brought to the upstream's current
    configuration (which drops a graph made under another one). One read of the task per
    process and configuration, none after; `fresh` reads it again (it was found deleted)."""
    task_id = task_id_for(upstream, values)
    env, tools = _spec(upstream, values)
    spec = canonical_json([env, tools])
    if fresh or _known.get(task_id) != spec:
        _task_made_sure(task_id, env, tools, spec)
    try:
        return task_handle(task_id=task_id, cached=not fresh)
    except NotFound:  # deleted since this process made sure of it
        if fresh:
            raise
        return task_ensure(upstream=upstream, values=values, fresh=True)


def _task_made_sure(task_id: str, env: dict, tools: dict, spec: bytes) -> None:
    current = Task.objects.filter(pk=task_id).values_list("env", "tools").first()
    if current is None or canonical_json(list(current)) != spec:
        try:
            task_put(task_id=task_id, env=env, tools=tools, sandbox_budget=0, audit_rate=0.0)
        except IntegrityError:  # another request created it at the same moment
            pass
    with _known_lock:
        if len(_known) >= MAX_KNOWN_TASKS:
            _known.clear()
        _known[task_id] = spec


def _extra(upstream: Upstream, item: ActionItem) -> dict:
    left_out = {*upstream.task_fields, *upstream.ignore_fields}
    return {key: value for key, value in item.tool_extra().items() if key not in left_out}


def action_call(upstream: Upstream, item: ActionItem) -> ToolCall | None:
    """The item's call, or None when the pattern does not match its action."""
    action = item.action
    if upstream.action_pattern:
        match = _compiled(upstream.action_pattern).search(action)
        if match is None:
            return None
        action = match.group(1) if match.re.groups else match.group(0)
        if action is None:  # the first group took no part in the match
            return None
    return ToolCall(ACTION, {"action": action, "extra": _extra(upstream, item)})


def passthrough_call(upstream: Upstream, item: ActionItem) -> ToolCall:
    return ToolCall(PASSTHROUGH, {"action": item.action, "extra": _extra(upstream, item)})
