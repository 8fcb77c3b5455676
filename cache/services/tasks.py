from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from django.conf import settings
from django.db import connection, transaction

from accounts.models import Project
from accounts.projects import key_project, role_check, task_public_id
from accounts.services.projects import project_named
from cache import ledger
from cache.hooks import sandbox_hooks
from cache.models import Divergence, MergeBan, Snapshot, Task
from cache.notfound import unknown_task
from cache.tcg import TaskPolicy, ToolPolicy, env_fingerprint
from core.errors import Conflict, InvalidInput, NotFound

from .hitcache import TaskStamp, hit_cache, version_move_wait_s
from .totals import task_totals_clear

BACKENDS = {"docker", "directory", "sqlite", "external"}
RETENTION_FIELDS = ("max_nodes", "max_result_bytes")  # Task's retention bounds


@dataclass(frozen=True, slots=True)
class TaskHandle:
    """What the hot paths need of a task, read in one query per request (a task may change)."""

    task_id: str
    version: int
    fingerprint: str
    policy: TaskPolicy
    backend: str
    sandbox_budget: int
    audit_rate: float = 0.0  # the fraction of hits sampled for the determinism audit
    divergent_writes: bool = False  # some state-changing node is divergent: lookups check their history
    created_at: datetime | None = None
    match: str = "history"  # Task.match: "state" serves state-keyed hits too (docs/design/state-match.md)

    @property
    def stamp(self) -> TaskStamp:
        """What the handle is valid under: the version, and the creation time (a task created again
        under the same key starts at version 1 again)."""
        return self.version, self.created_at

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
            "SELECT version, env_fingerprint, tools::text, env->>'backend', sandbox_budget, audit_rate,"
            " uncacheable_tools::text, EXISTS (SELECT FROM cache_node n WHERE n.task_id = t.id AND n.mutates"
            " AND n.divergent), created_at, match FROM cache_task t WHERE id = %s",
            [task_id],
        )
        row = cursor.fetchone()
    if row is None:
        _handles.pop(task_id, None)
        raise unknown_task(task_id)
    version, fingerprint, tools, backend, budget, audit_rate, uncacheable, divergent_writes, created_at, match = row
    handle = TaskHandle(
        task_id,
        version,
        fingerprint,
        _policy(tools, uncacheable),
        backend or "external",
        budget,
        audit_rate,
        divergent_writes,
        created_at,
        match,
    )
    if len(_handles) >= MAX_CACHED_HANDLES:
        _handles.clear()
    _handles[task_id] = handle
    return handle


def cached_task_handle(task_id: str) -> TaskHandle | None:
    """The handle this process holds for the task, maybe outdated; None if it holds none."""
    return _handles.get(task_id)


def task_version_move(task: Task) -> None:
    """Move the task's version, in the caller's transaction (the caller saves the row): every
    process re-reads its handle before its next lookup, and stops serving its cached hits of the
    task (hitcache.py). Every change that can make a hit unservable goes through here. Once the
    transaction commits, this waits the hit cache's window before the caller goes on, so that
    whoever gets the change's answer is never served a hit it made unservable, by any process."""
    if not connection.in_atomic_block:
        raise RuntimeError("a task's version moves inside the transaction that saves it")
    task.version += 1
    hit_cache().lease_drop(task.pk)  # this process's next lookup reads the task again
    transaction.on_commit(functools.partial(_version_moved, task.pk))


def _version_moved(task_id: str) -> None:
    hit_cache().lease_drop(task_id)  # (a lookup of this process may have read the old version meanwhile)
    wait_s = version_move_wait_s()
    if wait_s:
        time.sleep(wait_s)


@functools.lru_cache(maxsize=1024)
def _policy(tools_json: str, uncacheable_json: str = "[]") -> TaskPolicy:
    """The declared policy, less the caching of the tools the audit made uncacheable (they keep
    their declared effect on the state)."""
    return task_policy(orjson.loads(tools_json), orjson.loads(uncacheable_json))


def task_policy(tools: dict, uncacheable: list[str]) -> TaskPolicy:
    policy = TaskPolicy.from_json(tools)
    if not uncacheable:
        return policy
    return TaskPolicy(
        tools={
            **policy.tools,
            **{
                name: ToolPolicy(mutates_state=policy.for_tool(name).mutates_state, cacheable=False)
                for name in uncacheable
            },
        }
    )


def _check_backend(env: dict) -> None:
    backend = env.get("backend", "external")
    if backend not in BACKENDS:
        raise InvalidInput(
            f"Unknown backend '{backend}'.",
            code="unknown_backend",
            details={"field": "env.backend", "allowed": sorted(BACKENDS)},
        )


def _project_of(task_id: str) -> Project:
    name = key_project(task_id)
    project = project_named(name)
    if project is None:
        raise NotFound(f"Unknown project '{name}'.", code="unknown_project", details={"project": name})
    return project


@transaction.atomic
def task_put(
    *,
    task_id: str,
    env: dict,
    tools: dict | None = None,
    sandbox_budget: int | None = None,
    audit_rate: float | None = None,
    retention: dict[str, int | None] | None = None,
    match: str | None = None,
    actor: Any = None,
) -> tuple[Task, bool]:
    """Create or update the task keyed `task_id` (accounts.projects.task_key: its project is part of
    the key). A changed environment changes the fingerprint and drops the task's old nodes: they
    can never hit again, and keeping them would only mislead the graph. A changed `audit_rate`
    keeps them; an update that names no budget, or no `match`, keeps the task's. `retention`: the bounds it names
    (max_nodes, max_result_bytes; None: the project's default); those it leaves out are kept.

    `actor`: the API principal asking, if any. Changing an existing task's env, tools or budget
    takes the maintainer role (a trainer gets 403 maintainer_required; creating a task, or
    putting one again as it is, does not) and is written to the audit log in this transaction.
    The arguments are parsed already (cache.inputs.parse_task: the API's body)."""
    _check_backend(env)
    tools = tools or {}
    retention = _retention(retention or {})
    if audit_rate is None:
        audit_rate = settings.TVCACHE["DEFAULT_AUDIT_RATE"]
    project = _project_of(task_id)
    # An env that asks for more than the project is granted (network, images, limits) is refused
    # (403); what identifies it beyond its spec is part of its fingerprint.
    hooks = sandbox_hooks()
    hooks.grants_check(env, project)
    fingerprint = env_fingerprint({"env": env, "material": hooks.fingerprint_material(env)})
    with connection.cursor() as cursor:  # PUTs creating one task at once: each waits, then updates the first's
        cursor.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [f"task_put:{task_id}"])
    ledger.counters_quiet()  # a changed env drops the task's nodes
    task = Task.objects.select_for_update().filter(pk=task_id).first()
    if task is None:
        if sandbox_budget is None:
            sandbox_budget = settings.TVCACHE["DEFAULT_SANDBOX_BUDGET"]
        task = Task.objects.create(
            id=task_id,
            project=project,
            name=task_public_id(task_id),
            env=env,
            env_fingerprint=fingerprint,
            tools=tools,
            sandbox_budget=sandbox_budget,
            audit_rate=audit_rate,
            match=match or settings.TVCACHE["DEFAULT_MATCH"],
            **retention,
        )
        ledger.task_changed(task_id, "created")
        return task, True
    if sandbox_budget is None:
        sandbox_budget = task.sandbox_budget
    bounds = {name: getattr(task, name) for name in RETENTION_FIELDS}
    new_bounds = {**bounds, **retention}
    changed = [
        field
        for field, differs in (
            ("env", task.env_fingerprint != fingerprint),
            ("tools", task.tools != tools),
            ("sandbox_budget", task.sandbox_budget != sandbox_budget),
            ("retention", bounds != new_bounds),
        )
        if differs
    ]
    if changed and actor is not None:
        role_check(principal=actor, action=f"change an existing task's {' and '.join(changed)}")
    dropped = 0
    if task.env_fingerprint != fingerprint or task.tools != tools:
        # A changed tool policy changes the state keys too (what counts as a write).
        dropped = task.nodes.count()
        _drop_nodes(task)
    old = {
        "env_fingerprint": task.env_fingerprint,
        "tools": task.tools,
        "sandbox_budget": task.sandbox_budget,
        **bounds,
    }
    task.env, task.env_fingerprint, task.tools, task.sandbox_budget = env, fingerprint, tools, sandbox_budget
    task.audit_rate, task.match = audit_rate, match or task.match
    for name, value in new_bounds.items():
        setattr(task, name, value)
    task_version_move(task)  # every process re-reads its handle (keys, policy, audit rate)
    task.save()
    if changed and actor is not None:
        from .admin import audit_entry

        audit_entry(
            actor=actor,
            action="task_update",
            task_id=task_id,
            target=f"task {task.name} ({', '.join(changed)})",
            details={
                "changed": changed,
                "nodes_dropped": dropped,
                "old": old,
                "new": {
                    "env_fingerprint": fingerprint,
                    "tools": tools,
                    "sandbox_budget": sandbox_budget,
                    **new_bounds,
                },
            },
        )
    ledger.task_changed(task_id, "updated")
    return task, False


def _drop_nodes(task: Task) -> None:
    """A new graph starts with a clean audit: its divergences and the tools they made uncacheable
    were those of nodes that are gone (an environment or a policy that no longer holds), and so
    were the fingerprints it stopped merging (MergeBan). The nodes go in one statement: what
    refers to them (snapshots, divergences, the nodes' own parent links) goes first or with them,
    whereas the ORM's collector would load every node, results included, into this process (a
    task of millions of nodes would not fit in its memory)."""
    task_totals_clear(task_id=task.pk)  # first: it takes the totals rows before any node (totals.py)
    Snapshot.objects.filter(task=task).delete()
    Divergence.objects.filter(task=task).delete()
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM cache_node WHERE task_id = %s", [task.pk])
    MergeBan.objects.filter(task=task).delete()
    task.uncacheable_tools = []


def _retention(retention: dict[str, int | None]) -> dict[str, int | None]:
    unknown = set(retention) - set(RETENTION_FIELDS)
    if unknown:
        raise InvalidInput(f"Unknown retention bounds {sorted(unknown)}.", code="invalid_payload")
    return retention


@transaction.atomic
def task_flush(*, task_id: str) -> int:
    """Drop every node, snapshot, rollout and counter of a task; the task itself stays."""
    ledger.counters_quiet()
    task = Task.objects.select_for_update().filter(pk=task_id).first()
    if task is None:
        raise unknown_task(task_id)
    count = task.nodes.count()
    _drop_nodes(task)
    task_version_move(task)  # lookups holding the old handle re-read the task
    task.save(update_fields=["version", "uncacheable_tools", "updated_at"])
    with connection.cursor() as cursor:  # the bulk of a rollout's rows, in statements
        for table in ("cache_rolloutstep", "cache_rolloutcall"):
            cursor.execute(
                f"DELETE FROM {table} WHERE rollout_id IN (SELECT id FROM cache_rollout WHERE task_id = %s)", [task.pk]
            )
    # Only the keys are read; the collector deletes the trajectories and unlinks sandboxes.
    task.rollouts.only("pk").delete()
    task.tool_stats.all().delete()
    return count
