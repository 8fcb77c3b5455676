"""Branches: new rollouts that continue from a point of the graph, the way tree search samples
continuations from the middle of a trajectory. A point is "rollout R after `step` calls of its
history" (its state-changing calls) or a recorded node; the new rollouts start with the history
that reaches it, so their calls are looked up and executed after it like any rollout's.

Only a known state can be branched: every state-changing call of the history is recorded in the
graph, and none of their nodes is divergent (an audit found it differing, or its state kept
changing on its own). Anything else answers 409 `branch_state_unknown`."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import orjson
from django.db import IntegrityError, connection, transaction

from accounts.projects import task_public_id
from cache.models import Node, Rollout
from cache.notfound import unknown_node
from cache.tcg import ToolCall, state_chain
from core.errors import Conflict, InvalidInput, NotFound

from .rollouts import kept_histories_add, kept_history
from .tasks import task_handle

# The node and its ancestors, root first.
_ANCESTORS_SQL = """
WITH RECURSIVE up AS (
    SELECT id, parent_id, call, mutates, depth FROM cache_node WHERE task_id = %s AND id = %s
  UNION ALL
    SELECT n.id, n.parent_id, n.call, n.mutates, n.depth FROM cache_node n JOIN up ON n.id = up.parent_id
)
SELECT call::text, mutates FROM up ORDER BY depth
"""


@dataclass(frozen=True, slots=True)
class BranchPoint:
    history: tuple[ToolCall, ...]  # the state-changing calls that reach the point
    node_id: int | None  # the node whose call left that state (None: the task's root)
    rollout: str  # the rollout branched from ("" for a node)
    step: int | None


def branch_point(*, task_id: str, rollout: str | None, step: int | None, node_id: int | None) -> BranchPoint:
    """Where branches start, checked to be a known state."""
    if node_id is None:
        history = _rollout_prefix(task_id, rollout, step)
    else:
        history = _node_history(task_id, node_id)
    return BranchPoint(history, _known_state(task_id, history), rollout or "", step)


def _rollout_prefix(task_id: str, rollout: str, step: int) -> tuple[ToolCall, ...]:
    found = Rollout.objects.filter(task_id=task_id, rollout_id=rollout).values_list("pk", "history_length").first()
    if found is None:
        raise NotFound(
            f"Task '{task_public_id(task_id)}' has no rollout '{rollout}'.",
            code="unknown_rollout",
            details={"rollout": rollout},
        )
    pk, length = found
    if step > length:
        raise InvalidInput(
            f"Rollout '{rollout}' has {length} calls in its history; step {step} is past them.",
            code="branch_step_out_of_range",
            details={"field": "from.step", "max": length},
        )
    return kept_history(pk, step)


def _node_history(task_id: str, node_id: int) -> tuple[ToolCall, ...]:
    with connection.cursor() as cursor:
        cursor.execute(_ANCESTORS_SQL, [task_id, node_id])
        rows = cursor.fetchall()
    if not rows:
        raise unknown_node(task_id, node_id)
    return tuple(ToolCall.from_json(orjson.loads(call)) for call, mutates in rows if mutates)


def _known_state(task_id: str, history: tuple[ToolCall, ...]) -> int | None:
    """The node of the history's last state-changing call, once every one of them is recorded and
    none is divergent; None for the root."""
    task = task_handle(task_id=task_id)
    keys = [step.state_key for step in state_chain(task.fingerprint, history, task.policy).writes]
    if not keys:
        return None
    nodes = dict(
        Node.objects.filter(task_id=task_id, mutates=True, state_key__in=keys, divergent=False).values_list(
            "state_key", "id"
        )
    )
    missing = [key for key in keys if key not in nodes]
    if missing:
        raise Conflict(
            f"The state to branch from is not known: {len(missing)} of the {len(keys)} state-changing calls that "
            "reach it are not recorded, or were found to differ when run again.",
            code="branch_state_unknown",
        )
    return nodes[keys[-1]]


def rollouts_branch(
    *,
    task_id: str,
    point: BranchPoint,
    rollout_ids: tuple[str, ...],
    epoch: int,
    tokens: dict | None = None,
    trajectory_refs: tuple[str, ...] | None = None,
) -> list[Rollout]:
    """The branches' rollouts, each starting with the history that reaches the point (409 if a
    rollout id is taken); `tokens`, `trajectory_refs`: what the trainer said of them (Trace)."""
    refs = trajectory_refs or ("",) * len(rollout_ids)
    rows = [
        Rollout(
            task_id=task_id,
            rollout_id=rollout_id,
            epoch=epoch,
            history_length=len(point.history),
            branch_of=point.rollout,
            branch_step=point.step,
            branch_node=point.node_id,
            branch_tokens=None if tokens is None else {name: list(span) for name, span in tokens.items()},
            trajectory_ref=ref,
        )
        for rollout_id, ref in zip(rollout_ids, refs, strict=True)
    ]
    try:
        with transaction.atomic():
            made = Rollout.objects.bulk_create(rows)
            kept_histories_add(made, point.history)
            return made
    except IntegrityError:
        taken = list(
            Rollout.objects.filter(task_id=task_id, rollout_id__in=rollout_ids).values_list("rollout_id", flat=True)
        )
        raise Conflict(
            f"Rollout ids already in use: {', '.join(taken)}.", code="rollout_exists", details={"rollout_ids": taken}
        ) from None


def branch_ids(point: BranchPoint, count: int) -> tuple[str, ...]:
    """Rollout ids for branches the request did not name."""
    stem = f"{point.rollout}.{point.step}"[:180] if point.rollout else f"node{point.node_id or 0}"
    return tuple(f"{stem}.{uuid.uuid4().hex[:10]}" for _ in range(count))
