from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import orjson
from django.conf import settings
from django.db import connection, transaction

from cache.errors import Conflict, InvalidInput, NotFound
from cache.models import Node, Snapshot, Task
from cache.tcg import TaskPolicy, env_fingerprint
from dashboard import broadcast

BACKENDS = {"docker", "directory", "sqlite", "external"}


@dataclass(frozen=True, slots=True)
class TaskHandle:
    """What the hot paths need of a task, read in one query per request (a task may change)."""

    task_id: str
    version: int
    fingerprint: str
    policy: TaskPolicy
    backend: str
    sandbox_budget: int

    def check_fingerprint(self, expected: str | None) -> None:
        if expected is not None and expected != self.fingerprint:
            raise Conflict(
                "The task's environment changed since this rollout started; its results cannot be recorded.",
                code="env_changed",
                details={"expected": expected, "current": self.fingerprint},
            )


_handles: dict[str, TaskHandle] = {}
MAX_CACHED_HANDLES = 10_000


def task_handle(*, task_id: str, cached: bool = False) -> TaskHandle:
    """The task's keys and policy. `cached=True` may return an outdated handle: only for callers
    that check `version` in the same statement that uses the keys (see lookup)."""
    if cached and task_id in _handles:
        return _handles[task_id]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT version, env_fingerprint, tools::text, env->>'backend', sandbox_budget FROM cache_task WHERE id = %s",
            [task_id],
        )
        row = cursor.fetchone()
    if row is None:
        _handles.pop(task_id, None)
        raise NotFound(f"Unknown task '{task_id}'.", code="unknown_task", details={"task_id": task_id})
    version, fingerprint, tools, backend, budget = row
    handle = TaskHandle(task_id, version, fingerprint, _policy(tools), backend or "external", budget)
    if len(_handles) >= MAX_CACHED_HANDLES:
        _handles.clear()
    _handles[task_id] = handle
    return handle


@functools.lru_cache(maxsize=1024)
def _policy(tools_json: str) -> TaskPolicy:
    return TaskPolicy.from_json(orjson.loads(tools_json))


def _validate_tools(tools: Any) -> dict:
    if not isinstance(tools, dict):
        raise InvalidInput("'tools' must be an object of tool policies.", code="invalid_payload", details={"field": "tools"})
    clean = {}
    for name, spec in tools.items():
        if not isinstance(spec, dict) or set(spec) - {"mutates_state", "cacheable"}:
            raise InvalidInput(f"Tool '{name}' must be {{mutates_state, cacheable}}.", code="invalid_payload",
                               details={"field": f"tools.{name}"})
        if any(not isinstance(value, bool) for value in spec.values()):
            raise InvalidInput(f"Tool '{name}' flags must be booleans.", code="invalid_payload", details={"field": f"tools.{name}"})
        clean[name] = {"mutates_state": spec.get("mutates_state", True), "cacheable": spec.get("cacheable", True)}
    return clean


def _validate_env(env: Any) -> dict:
    if not isinstance(env, dict):
        raise InvalidInput("'env' must be an object.", code="invalid_payload", details={"field": "env"})
    backend = env.get("backend", "external")
    if backend not in BACKENDS:
        raise InvalidInput(f"Unknown backend '{backend}'.", code="unknown_backend", details={"field": "env.backend", "allowed": sorted(BACKENDS)})
    return env


def _fingerprint_material(env: dict) -> dict:
    """What identifies a managed environment beyond its spec (the docker image id, the sqlite
    seed's hash): a rebuilt image is a new environment, so its tasks' old results never hit."""
    from sandboxes.backends.base import SandboxError
    from sandboxes.services.runtime import as_application_error, backend_named, is_managed

    if not is_managed(env.get("backend", "external")):
        return {}
    try:
        return backend_named(env["backend"]).fingerprint_material(env)
    except SandboxError as exc:
        raise as_application_error(exc) from None


@transaction.atomic
def task_put(*, task_id: str, env: Any, tools: Any = None, sandbox_budget: Any = None) -> tuple[Task, bool]:
    """Create or update a task. A changed environment changes the fingerprint and drops the
    task's old nodes: they can never hit again, and keeping them would only mislead the graph."""
    env = _validate_env(env)
    tools = _validate_tools(tools or {})
    if sandbox_budget is None:
        sandbox_budget = settings.TVCACHE["DEFAULT_SANDBOX_BUDGET"]
    if not isinstance(sandbox_budget, int) or isinstance(sandbox_budget, bool) or sandbox_budget < 0:
        raise InvalidInput("'sandbox_budget' must be a non-negative integer.", code="invalid_payload", details={"field": "sandbox_budget"})
    fingerprint = env_fingerprint({"env": env, "material": _fingerprint_material(env)})
    task = Task.objects.select_for_update().filter(pk=task_id).first()
    if task is None:
        task = Task.objects.create(id=task_id, env=env, env_fingerprint=fingerprint, tools=tools,
                                   sandbox_budget=sandbox_budget)
        broadcast.task_changed(task_id, "created")
        return task, True
    if task.env_fingerprint != fingerprint or task.tools != tools:
        # A changed tool policy changes the state keys too (what counts as a write).
        _drop_nodes(task)
    task.env, task.env_fingerprint, task.tools, task.sandbox_budget = env, fingerprint, tools, sandbox_budget
    task.version += 1
    task.save()
    broadcast.task_changed(task_id, "updated")
    return task, False


def _drop_nodes(task: Task) -> None:
    Snapshot.objects.filter(task=task).delete()
    Node.objects.filter(task=task).delete()


@transaction.atomic
def task_flush(*, task_id: str) -> int:
    """Drop every node, snapshot, rollout and counter of a task; the task itself stays."""
    task = Task.objects.select_for_update().filter(pk=task_id).first()
    if task is None:
        raise NotFound(f"Unknown task '{task_id}'.", code="unknown_task")
    count = task.nodes.count()
    _drop_nodes(task)
    task.version += 1  # lookups holding the old handle re-read the task
    task.save(update_fields=["version", "updated_at"])
    task.rollouts.all().delete()
    task.tool_stats.all().delete()
    return count
