"""The determinism audit: tools are assumed deterministic, and this checks it (docs/design/guarantees.md).

A sampled fraction of hits (`Task.audit_rate`, sampled by the lookup in process) is re-executed
at the hit's parent state: by a worker in tool-server mode (`sandboxes.services.audit`), by the
client's own environment in client mode (`node_audit`). A result that differs from the node's is a
divergence: the node stops being served, and a tool with more than AUDIT_MAX_DIVERGENT divergent
nodes in a task stops being cached for that task (written to the audit log). A sandbox
materialized for a node whose state fingerprint differs from the node's is a divergence too
(kind "state"); it says nothing about the node's result, so the node stays served. A state that
kept changing after its call returned (kind "drift": a process the call left running writes files)
is not a function of the history: its node stops being served, as an audit's would. A divergence
from a state with a verified fingerprint stops state-keyed hits from it (`_merges_stop`).
"""

from __future__ import annotations

from typing import Any

import orjson
from django.conf import settings
from django.db import transaction

from cache import ledger
from cache.models import AuditEntry, Divergence, MergeBan, Node, Task, TaskTotal
from cache.notfound import unknown_node, unknown_task
from cache.tcg import same_result

from .admin import system_entry
from .tasks import task_version_move
from .totals import task_totals_add


def divergence_record(
    *, task_id: str, node_id: int | None, tool: str, kind: str, expected: Any, observed: Any, rollout_id: str = ""
) -> Divergence:
    """Store a divergence. Kind "audit" also marks the node divergent (no longer served) and,
    past the task's limit of divergent nodes for the tool, makes the tool uncacheable. Kind "drift"
    (the state the node's call left kept changing: it depends on timing) marks the node only."""
    if kind not in Divergence.Kind.values:
        raise ValueError(f"unknown divergence kind {kind!r}")
    with transaction.atomic():
        # The task's row first: divergences of one task are counted one after the other, so that
        # two at once cannot each see the other's node uncounted.
        task = Task.objects.select_for_update().filter(pk=task_id).first()
        if task is None:
            raise unknown_task(task_id)
        if node_id is not None and not Node.objects.filter(task_id=task_id, pk=node_id).exists():
            node_id = None  # evicted meanwhile: the divergence still happened
        divergence = Divergence.objects.create(
            task=task,
            node_id=node_id,
            tool=tool,
            kind=kind,
            expected=expected,
            observed=observed,
            rollout_id=rollout_id[:200],
        )
        stopped = node_id is not None and _merges_stop(task, node_id, state=kind == Divergence.Kind.STATE)
        if kind in (Divergence.Kind.AUDIT, Divergence.Kind.DRIFT) and node_id is not None:
            marked = _mark(task, node_id)
            limited = _limit_tool(task, tool) if kind == Divergence.Kind.AUDIT else None
            if marked or limited or stopped:
                task_version_move(task)
                task.save(update_fields=["version", "uncacheable_tools", "updated_at"])
            if limited:
                system_entry(
                    action=AuditEntry.Action.TOOL_UNCACHEABLE,
                    task_id=task.pk,
                    target=f"task {task.pk} / tool {tool}",
                    details=limited,
                )
                ledger.task_changed(task.pk, "uncacheable")
        elif stopped:
            task_version_move(task)
            task.save(update_fields=["version", "updated_at"])
    return divergence


def _merges_stop(task: Task, node_id: int, *, state: bool) -> bool:
    """A divergence on a node whose call started from a state with a verified fingerprint stops
    state-keyed hits from every state with that fingerprint (MergeBan): the call was not a function
    of the state there, so neither is any merge at it. The nodes merged at it stop being served
    (and nothing below them: lookup.py), so both histories' later lookups go by history keys only.
    A "state" divergence (a sandbox materialized for the node is not in its recorded state) stops
    merging only when the node is a merged one: its recorded state is its merge's. Whether a node
    was marked (the caller moves the task's version)."""
    node = Node.objects.filter(pk=node_id).values("merged_from", "parent__state_fingerprint").first()
    fingerprint = node and node["parent__state_fingerprint"]
    if not fingerprint or (state and node["merged_from"] is None):
        return False
    MergeBan.objects.get_or_create(task=task, fingerprint=fingerprint, defaults={"node_id": node_id})
    merged = Node.objects.filter(
        task=task, merged_from__isnull=False, divergent=False, parent__state_fingerprint=fingerprint
    ).values_list("pk", flat=True)
    return any([_mark(task, pk) for pk in merged])


def _mark(task: Task, node_id: int) -> bool:
    """The node is no longer served, and below a state-changing one nothing is (lookup.py): the
    task's version moves (the caller moves it) so that every process's handle learns that lookups
    must check for it, and no process serves the node from its cache of hits. False: divergent
    already."""
    tool = Node.objects.filter(pk=node_id, divergent=False).values_list("tool", flat=True).first()
    # The UPDATE decides: of two marks at once only one matches the row, and only it counts.
    if tool is None or not Node.objects.filter(pk=node_id, divergent=False).update(divergent=True):
        return False
    task_totals_add(task_id=task.pk, tool=tool, divergent=1)
    ledger.node_changed(task.pk, node_id, divergent=True)
    return True


def _limit_tool(task: Task, tool: str) -> dict | None:
    """Past the limit of divergent nodes, the tool becomes uncacheable for the task (every process
    re-reads the task's policy before its next lookup: the caller moves the version). What the
    audit log says of it, or None."""
    limit = settings.TVCACHE["AUDIT_MAX_DIVERGENT"]
    if tool in task.uncacheable_tools:
        return None
    divergent = TaskTotal.objects.filter(task_id=task.pk, tool=tool).values_list("divergent", flat=True).first() or 0
    if divergent <= limit:
        return None
    task.uncacheable_tools = [*task.uncacheable_tools, tool]
    return {"tool": tool, "divergent_nodes": divergent, "limit": limit}


def node_audit(*, task_id: str, node_id: int, result: Any, rollout_id: str = "") -> bool:
    """A client's re-execution of a hit at its parent state: whether it differs from the node's
    result (the whole result, its bytes); a difference is recorded."""
    row = Node.objects.filter(task_id=task_id, pk=node_id).values_list("tool", "result_json").first()
    if row is None:
        raise unknown_node(task_id, node_id)
    tool, result_json = row
    if same_result(result_json, result):
        return False
    divergence_record(
        task_id=task_id,
        node_id=node_id,
        tool=tool,
        kind=Divergence.Kind.AUDIT,
        expected=orjson.loads(result_json),
        observed=result,
        rollout_id=rollout_id,
    )
    return True
