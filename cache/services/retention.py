"""Retention: a task keeps at most `max_nodes` nodes and `max_result_bytes` bytes of results (its
own bounds, else its project's defaults, else unbounded). The periodic job that enforces snapshot
budgets (sandboxes.services.snapshots_collect) evicts, beyond them, the subtrees least likely to be
reused (cache.tcg.eviction.retention_order), leaves first, and deletes them (nodes.nodes_delete):
their lookups miss and a rollout that gets there again executes and records afresh; what they
counted stays. docs/operations/retention.md says what is spared and why.

The same job expires rollouts (`rollouts_expire`): a rollout's row, its steps and its kept calls
are the history of what it ran, read by the tree export and the dashboard; once it has ended, or
keeps no history of its own (a client-mode rollout sends its history with every call), and was
neither started nor answered for TVCACHE_HISTORY_KEEP_S, they are deleted. The task's stats still
count it (cache_rollouttotal.expired) and what it hit and saved (the tool stats).

A node is spared, with its ancestors (a path stays a prefix), when it is
- pinned;
- on a live rollout's path: created or hit within TVCACHE_RETENTION_LIVE_S (each call of a
  rollout hits or records a node, whose ancestors are the rollout's path), or the state a claimed
  call is executing in (a client-mode rollout between its miss and its record);
- holding a snapshot not done with: live (the snapshot budget decides those; a lease holds only
  live ones), a service snapshot whose storage is not freed yet, or a client snapshot whose
  eviction is still being reported (snapshots.EVICTION_NOTICE_S).
"""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import connection, transaction

from cache import ledger
from cache.models import Node, Rollout, Snapshot, Task
from cache.tcg.eviction import NodeCandidate, RetentionBudget, retention_order

from .nodes import nodes_delete
from .snapshots import EVICTION_NOTICE_S
from .totals import task_totals_lock

log = logging.getLogger("tvcache.retention")

# The bounded tasks with their bounds (the task's own, else the project's) and totals.
BOUNDED_SQL = """
SELECT t.id, coalesce(t.max_nodes, p.task_max_nodes), coalesce(t.max_result_bytes, p.task_max_result_bytes),
       (SELECT coalesce(sum(tt.nodes), 0) FROM cache_tasktotal tt WHERE tt.task_id = t.id),
       (SELECT coalesce(sum(tt.result_bytes), 0) FROM cache_tasktotal tt WHERE tt.task_id = t.id)
FROM cache_task t JOIN accounts_project p ON p.id = t.project_id
WHERE coalesce(t.max_nodes, p.task_max_nodes) IS NOT NULL
   OR coalesce(t.max_result_bytes, p.task_max_result_bytes) IS NOT NULL
ORDER BY t.id
"""

# Why a node may not go (the module's docstring), over the nodes `n` of a statement.
PROTECTED = """(
    n.pinned
    OR greatest(n.created_at, n.last_hit_at) > now() - make_interval(secs => %(live_s)s)
    OR (n.mutates AND EXISTS (SELECT FROM cache_claim c WHERE c.task_id = n.task_id AND decode(c.anchor_key, 'hex') = n.state_key
                                                          AND c.expires_at > clock_timestamp()))
    OR EXISTS (SELECT FROM cache_snapshot s WHERE s.node_id = n.id AND (
        s.status = 'live'
        OR s.status = 'evicted' AND (s.owner = 'service' OR s.evicted_at > now() - make_interval(secs => %(notice_s)s))
        OR EXISTS (SELECT FROM cache_lease l WHERE l.snapshot_id = s.id AND l.released_at IS NULL
                                              AND l.expires_at > now())))
)"""

CANDIDATES_SQL = f"""
SELECT n.id, n.parent_id, n.depth, n.result_bytes, n.hit_count, n.exec_ms,
       extract(epoch FROM now() - greatest(n.created_at, n.last_hit_at))::float8, {PROTECTED}
FROM cache_node n WHERE n.task_id = %(task)s
"""

# Among the chosen nodes, once locked: those that may no longer go (used, claimed, snapshotted or
# leased since they were read, or given a child that was not chosen).
BLOCKED_SQL = f"""
SELECT n.id FROM cache_node n
WHERE n.id = ANY(%(ids)s) AND ({PROTECTED}
    OR EXISTS (SELECT FROM cache_node c WHERE c.parent_id = n.id AND NOT c.id = ANY(%(ids)s)))
"""


def tasks_enforce_retention(*, live_s: float | None = None) -> dict[str, int]:
    """Enforce the retention of every bounded task that is over its bounds."""
    evicted = over = 0
    for task_id, budget, nodes, result_bytes in _bounded_tasks():
        if any(budget.over(nodes, result_bytes)):
            over += 1
            evicted += len(task_enforce_retention(task_id=task_id, live_s=live_s))
    return {"tasks_over_retention": over, "nodes_evicted": evicted}


def task_enforce_retention(*, task_id: str, live_s: float | None = None, batch: int | None = None) -> list[int]:
    """Evict the task's coldest subtrees until it is within its retention bounds or nothing more may
    go; a transaction (and one move of the task's version) per `batch` nodes. The ids deleted."""
    batch = batch or settings.TVCACHE["RETENTION_BATCH"]
    live_s = settings.TVCACHE["RETENTION_LIVE_S"] if live_s is None else live_s
    deleted: list[int] = []
    while True:
        chosen, full = _retention_batch(task_id, live_s, batch)
        deleted += chosen
        if not full:
            break
    if deleted:
        log.info("retention evicted %d nodes of task %s", len(deleted), task_id)
    return deleted


def _bounded_tasks() -> list[tuple[str, RetentionBudget, int, int]]:
    with connection.cursor() as cursor:
        cursor.execute(BOUNDED_SQL)
        return [(row[0], RetentionBudget(row[1], row[2]), row[3], row[4]) for row in cursor.fetchall()]


def _retention_batch(task_id: str, live_s: float, batch: int) -> tuple[list[int], bool]:
    """One batch: the nodes deleted, and whether the batch was full (more may have to go)."""
    params = {"task": task_id, "live_s": live_s, "notice_s": EVICTION_NOTICE_S}
    with transaction.atomic():
        ledger.counters_quiet()  # before any row: the nodes deleted are counted rows
        # The task's row first, as every deletion of nodes locks it (records go on: no key update).
        task = Task.objects.select_for_update(no_key=True, of=("self",)).select_related("project")
        task = task.filter(pk=task_id).first()
        if task is None:
            return [], False
        budget = RetentionBudget(
            task.max_nodes if task.max_nodes is not None else task.project.task_max_nodes,
            task.max_result_bytes if task.max_result_bytes is not None else task.project.task_max_result_bytes,
        )
        if not budget.bounded:
            return [], False
        task_totals_lock(task_id=task_id)  # before any node (totals.py)
        order = retention_order(_candidates(params), budget)
        full = len(order) > batch
        chosen = order[:batch]  # every prefix of the order keeps what stays closed under parents
        if not chosen:
            return [], False
        list(Node.objects.select_for_update().filter(pk__in=chosen).order_by("pk").values_list("pk", flat=True))
        list(Snapshot.objects.select_for_update().filter(node_id__in=chosen).order_by("pk").values_list("pk"))
        chosen = _still_evictable(chosen, params)
        nodes_delete(task=task, node_ids=chosen)
    return chosen, full and bool(chosen)


def _candidates(params: dict) -> list[NodeCandidate]:
    with connection.cursor() as cursor:
        cursor.execute(CANDIDATES_SQL, params)
        return [NodeCandidate(*row) for row in cursor.fetchall()]


def _still_evictable(chosen: list[int], params: dict) -> list[int]:
    """The chosen nodes less those that may no longer go and their ancestors among them (what is
    left is still closed under descendants: a node goes only with everything below it)."""
    with connection.cursor() as cursor:
        cursor.execute(BLOCKED_SQL, {**params, "ids": chosen})
        blocked = {row[0] for row in cursor.fetchall()}
        if not blocked:
            return chosen
        cursor.execute("SELECT id, parent_id FROM cache_node WHERE id = ANY(%s)", [chosen])
        parents = dict(cursor.fetchall())
    keep = set()
    for node_id in blocked:
        while node_id in parents and node_id not in keep:
            keep.add(node_id)
            node_id = parents[node_id]
    return [node_id for node_id in chosen if node_id not in keep]


# Rollouts to expire: started and last answered before the cutoff, and either ended or keeping no
# history of their own (an unfinished rollout with a kept history may still come back for its next
# call: its history is what its sandbox is rebuilt from). The oldest first, locked, skipping those a
# counter flush or a call holds.
EXPIRING_SQL = """
SELECT r.id, r.task_id FROM cache_rollout r
WHERE r.started_at < now() - make_interval(secs => %(keep_s)s)
  AND (r.history_length = 0 OR r.finished_at IS NOT NULL OR r.detached_at IS NOT NULL)
  AND NOT EXISTS (SELECT FROM cache_rolloutstep s WHERE s.rollout_id = r.id
                  AND s.at > (extract(epoch FROM now()) - %(keep_s)s) * 1e9)
ORDER BY r.started_at LIMIT %(batch)s
FOR UPDATE OF r SKIP LOCKED
"""

EXPIRED_SQL = """
UPDATE cache_rollouttotal t SET expired = t.expired + c.n
FROM (SELECT task_id, count(*) AS n FROM unnest(%s::varchar[]) AS task_id GROUP BY task_id) c
WHERE t.task_id = c.task_id
"""


def rollouts_expire(*, keep_s: float | None = None, batch: int | None = None) -> dict[str, int]:
    """Delete the rollouts nothing needs any more (the module's docstring), with their steps, kept
    calls and trajectories, a transaction per `batch`; TVCACHE_HISTORY_KEEP_S = 0 keeps them all."""
    keep_s = settings.TVCACHE["HISTORY_KEEP_S"] if keep_s is None else keep_s
    batch = batch or settings.TVCACHE["RETENTION_BATCH"]
    expired = 0
    while keep_s > 0:
        with transaction.atomic():
            ledger.counters_quiet()  # before any row: a flush writes rollouts and their steps
            with connection.cursor() as cursor:
                cursor.execute(EXPIRING_SQL, {"keep_s": keep_s, "batch": batch})
                rows = cursor.fetchall()
                if not rows:
                    break
                # Only the key is read; the collector deletes the steps, kept calls and trajectories
                # and unlinks sandboxes (a reaped one keeps its row).
                Rollout.objects.filter(pk__in=[row[0] for row in rows]).only("pk").delete()
                cursor.execute(EXPIRED_SQL, [[row[1] for row in rows]])
        expired += len(rows)
        if len(rows) < batch:
            break
    if expired:
        log.info("expired %d rollouts", expired)
    return {"rollouts_expired": expired}
