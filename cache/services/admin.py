"""Staff and maintainer actions on the cache. Each is one mutation in one transaction, written to
the audit log (`cache.models.AuditEntry`: who, when, what, outcome, in which project) in that
same transaction; a refused or failed action is logged too, and its error re-raised for the
caller to show. The actor is a dashboard user (staff or a project's maintainer: the dashboard
checks) or an API principal (`accounts.services.tokens.Principal`: a trainer token is refused here, after
its target was found, with 403 maintainer_required, and that refusal is logged too).

Evicting a subtree deletes it: the live snapshots of the node and of all its descendants are
evicted and the nodes themselves, with their results, are deleted, so the subtree is gone from
the graph and the API and the next rollout that gets there executes and records it afresh. (Use
it to drop results that are wrong or stale; evicting only a node's snapshot keeps its results.)
A snapshot held by a lease blocks both: eviction never touches a referenced snapshot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import transaction

from accounts.models import Project
from accounts.projects import key_project, role_check, task_public_id
from cache import (
    ledger,
    selectors,  # a module, not its names: cache.selectors imports this package
)
from cache.models import AuditEntry, Lease, Node, Snapshot, Task
from cache.notfound import unknown_node, unknown_task
from core.errors import ApplicationError, Conflict, InvalidInput, NotFound

from .nodes import nodes_delete
from .snapshots import snapshot_evict, task_enforce_budget
from .tasks import task_flush
from .totals import task_totals_lock


def action_audited(*, actor, action: str, task_id: str, target: str, run: Callable[[], dict]) -> AuditEntry:
    """Run the action `run` in one transaction with its audit entry (its details are what `run`
    returns); a refused or failed action is logged too, and its error re-raised."""
    try:
        with transaction.atomic():
            if getattr(actor, "role", None) is not None:  # an API token: maintainers only
                role_check(principal=actor, action=AuditEntry.Action(action).label.lower())
            details = run()
            return _entry(actor, action, task_id, target, AuditEntry.Outcome.OK, details)
    except ApplicationError as exc:
        _entry(
            actor,
            action,
            task_id,
            target,
            AuditEntry.Outcome.REFUSED,
            {"code": exc.code, "message": exc.message, "details": exc.details},
        )
        raise
    except Exception as exc:
        _entry(
            actor, action, task_id, target, AuditEntry.Outcome.FAILED, {"code": type(exc).__name__, "message": str(exc)}
        )
        raise


def _entry(actor, action: str, task_id: str, target: str, outcome: str, details: dict) -> AuditEntry:
    user = actor if getattr(actor, "pk", None) is not None else None
    name = actor.get_username() if user is not None else str(actor or "system")  # a token: "token:<name>"
    project = Project.objects.filter(name=key_project(task_id)).first() if task_id else None
    return AuditEntry.objects.create(
        actor=user,
        actor_name=name[:150],
        action=action,
        task_id=task_id,
        project=project,
        target=target[:300],
        outcome=outcome,
        details=details,
    )


def audit_entry(*, actor, action: str, task_id: str, target: str, details: dict) -> AuditEntry:
    """An entry for an action done elsewhere in the caller's transaction (task_put's changes)."""
    return _entry(actor, action, task_id, target, AuditEntry.Outcome.OK, details)


def _named(task_id: str) -> str:
    """How a target names a task: its id and, outside the default project, its project."""
    project, name = key_project(task_id), task_public_id(task_id)
    return f"task {name}" if task_id == name else f"task {name} (project {project})"


def system_entry(*, action: str, task_id: str, target: str, details: dict) -> AuditEntry:
    """An entry for what the service decided on its own (no staff member acted)."""
    return _entry("tvcache", action, task_id, target, AuditEntry.Outcome.OK, details)


def _node_for_update(task_id: str, node_id: int) -> Node:
    node = Node.objects.select_for_update().defer("file_times").filter(task_id=task_id, pk=node_id).first()
    if node is None:
        raise unknown_node(task_id, node_id)
    return node


def _subtree_locked(task_id: str, node_id: int) -> list[int]:
    """The node's subtree, its rows locked for deletion (the task's totals are locked already:
    totals.task_totals_lock). A child recorded before its parent's lock is found by the next read
    of the subtree: until none is, the newcomers are locked too, so the delete removes the whole
    subtree and the totals lose exactly the nodes it removes."""
    taken: set[int] = set()
    while True:
        new = sorted(set(selectors.node_subtree_ids(task_id=task_id, node_id=node_id)) - taken)
        if not new:
            return sorted(taken)
        found = Node.objects.select_for_update().filter(task_id=task_id, pk__in=new).values_list("pk", flat=True)
        found = list(found)
        if not found:  # deleted meanwhile by another
            return sorted(taken)
        taken.update(found)


def _open_leases(snapshots: list[Snapshot]) -> list[int]:
    from django.utils import timezone

    return sorted(
        set(
            Lease.objects.filter(
                snapshot__in=snapshots, released_at__isnull=True, expires_at__gt=timezone.now()
            ).values_list("snapshot_id", flat=True)
        )
    )


def _snapshot_json(snapshot: Snapshot) -> dict[str, Any]:
    return {
        "snapshot_id": snapshot.pk,
        "node_id": snapshot.node_id,
        "ref": snapshot.ref,
        "backend": snapshot.backend,
        "owner": snapshot.owner,
        "size_bytes": snapshot.size_bytes,
    }


def admin_subtree_evict(*, actor, task_id: str, node_id: int) -> AuditEntry:
    """Evict the live snapshots of a node and its descendants and delete those nodes. The task's
    version moves: no process serves those nodes from its cache of hits once this has answered (a
    deleted node's result would still be right for its history, but its id would be gone)."""

    def run() -> dict:
        ledger.counters_quiet()  # before any row: the nodes deleted are counted rows
        # The task's row first, as the audit's divergences lock it (no key update: records go on).
        task = Task.objects.select_for_update(no_key=True).filter(pk=task_id).first()
        if task is None:
            raise unknown_task(task_id)
        task_totals_lock(task_id=task_id)  # then the nodes: the order a record takes them in
        node = _node_for_update(task_id, node_id)
        ids = _subtree_locked(task_id, node_id)
        live = list(
            Snapshot.objects.select_for_update().filter(node_id__in=ids, status=Snapshot.Status.LIVE).order_by("pk")
        )
        leased = _open_leases(live)
        if leased:
            raise Conflict(
                "A rollout holds a lease on a snapshot in this subtree; try again once it is released.",
                code="snapshot_leased",
                details={"snapshot_ids": leased},
            )
        # Deleting the nodes cascades to their snapshots (live and evicted) and released leases.
        evicted = [_snapshot_json(s) for s in nodes_delete(task=task, node_ids=ids)]
        return {
            "node": {"id": node.pk, "tool": node.tool, "depth": node.depth},
            "nodes_deleted": len(ids),
            "snapshots_evicted": evicted,
        }

    return action_audited(
        actor=actor,
        action=AuditEntry.Action.SUBTREE_EVICT,
        task_id=task_id,
        target=f"{_named(task_id)} / node {node_id} (subtree)",
        run=run,
    )


def admin_snapshot_evict(*, actor, task_id: str, node_id: int) -> AuditEntry:
    """Evict only the node's live snapshot; its result stays cached."""

    def run() -> dict:
        snapshot = (
            Snapshot.objects.select_for_update()
            .filter(task_id=task_id, node_id=node_id, status=Snapshot.Status.LIVE)
            .first()
        )
        if snapshot is None:
            raise NotFound(
                f"Node {node_id} of task '{task_public_id(task_id)}' has no live snapshot.",
                code="no_live_snapshot",
                details={"task_id": task_public_id(task_id), "node_id": node_id},
            )
        if not snapshot_evict(snapshot=snapshot):
            raise Conflict(
                "A rollout holds a lease on this snapshot; try again once it is released.",
                code="snapshot_leased",
                details={"snapshot_ids": [snapshot.pk]},
            )
        return {"snapshot": _snapshot_json(snapshot)}  # snapshot_evict announces it

    return action_audited(
        actor=actor,
        action=AuditEntry.Action.SNAPSHOT_EVICT,
        task_id=task_id,
        target=f"{_named(task_id)} / node {node_id} (snapshot)",
        run=run,
    )


def admin_node_pin(*, actor, task_id: str, node_id: int, pinned: bool) -> AuditEntry:
    """Pin (never evict its snapshot) or unpin a node."""

    def run() -> dict:
        node = _node_for_update(task_id, node_id)
        was = node.pinned
        Node.objects.filter(pk=node.pk).update(pinned=pinned)
        ledger.node_changed(task_id, node_id, pinned=pinned)
        return {"pinned": pinned, "was_pinned": was}

    action = AuditEntry.Action.NODE_PIN if pinned else AuditEntry.Action.NODE_UNPIN
    return action_audited(
        actor=actor, action=action, task_id=task_id, target=f"{_named(task_id)} / node {node_id}", run=run
    )


def admin_task_flush(*, actor, task_id: str) -> AuditEntry:
    """Drop every node, snapshot, rollout and counter of the task (the task stays)."""

    def run() -> dict:
        live = list(Snapshot.objects.filter(task_id=task_id, status=Snapshot.Status.LIVE).values_list("ref", flat=True))
        nodes = task_flush(task_id=task_id)
        ledger.task_changed(task_id, "flushed")
        return {"nodes_deleted": nodes, "snapshots_evicted": live}

    return action_audited(
        actor=actor, action=AuditEntry.Action.TASK_FLUSH, task_id=task_id, target=_named(task_id), run=run
    )


def admin_budget_set(*, actor, task_id: str, sandbox_budget: Any) -> AuditEntry:
    """Change a task's budget of live snapshots, then enforce it (evicting the least useful)."""

    def run() -> dict:
        if not isinstance(sandbox_budget, int) or isinstance(sandbox_budget, bool) or sandbox_budget < 0:
            raise InvalidInput(
                "The budget must be a non-negative integer.",
                code="invalid_budget",
                details={"sandbox_budget": sandbox_budget},
            )
        task = Task.objects.select_for_update().filter(pk=task_id).first()
        if task is None:
            raise unknown_task(task_id)
        old = task.sandbox_budget
        task.sandbox_budget = sandbox_budget
        task.save(update_fields=["sandbox_budget", "updated_at"])
        evicted = task_enforce_budget(task_id=task_id)  # announces what it evicts
        ledger.task_changed(task_id, "budget")
        return {"old": old, "new": sandbox_budget, "snapshots_evicted": [_snapshot_json(s) for s in evicted]}

    return action_audited(
        actor=actor,
        action=AuditEntry.Action.BUDGET_SET,
        task_id=task_id,
        target=f"{_named(task_id)} (budget {sandbox_budget})",
        run=run,
    )
