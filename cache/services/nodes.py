"""Deleting nodes: the one place results leave a task's graph (a staff member's subtree eviction,
retention). What a deleted node counted stays (ToolStat, the epoch figures, rollouts' calls and
hits); its rollout steps stay too and keep its id, which the tree export shows without tool,
digest or time (cache/services/trees.py); its divergences stay with no node."""

from __future__ import annotations

from collections.abc import Collection

from cache import ledger
from cache.models import Node, Snapshot, Task

from .tasks import task_version_move
from .totals import task_totals_remove


def nodes_delete(*, task: Task, node_ids: Collection[int]) -> list[Snapshot]:
    """Delete the task's nodes `node_ids` with their snapshots, in the caller's transaction, and
    move the task's version once, so that no process serves them from its cache of hits once the
    caller has answered (a deleted node's result would still be right for its history, but its id
    would be gone), and take them off the task's totals (totals.py). The caller holds the task's
    row (FOR NO KEY UPDATE), its totals (totals.task_totals_lock), then the nodes' and their
    snapshots' rows, in that order; took `ledger.counters_quiet()` before any of them; checked that
    no open lease holds a snapshot among them; and passes every descendant of a node it deletes
    (what stays keeps its parents). Returns the live snapshots deleted, which are announced here:
    they do not go through snapshot_evict."""
    ids = task_totals_remove(task_id=task.pk, node_ids=list(node_ids))  # exactly the ids deleted
    if not ids:
        return []
    live = list(Snapshot.objects.filter(node_id__in=ids, status=Snapshot.Status.LIVE).order_by("pk"))
    # Only the key is read: the collector fetches the rows it cascades to (snapshots, released
    # leases, divergences to unlink), never the results.
    Node.objects.filter(task_id=task.pk, pk__in=ids).only("pk").delete()
    task_version_move(task)
    task.save(update_fields=["version", "updated_at"])
    ledger.nodes_removed(task.pk, ids)
    for snapshot in live:
        ledger.snapshot_event(task.pk, "evicted", node_id=snapshot.node_id, ref=snapshot.ref, snapshot_id=snapshot.pk)
    return live
