"""Lookup: one indexed read for a hit, one more for the longest-prefix match on a miss.

Counters (node hits, per-tool stats, rollout counts) are updated in the same statement as the
read, so a lookup costs the same number of round trips whatever the history length.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import connection
from django.utils import timezone

from cache.inputs import CallContext
from cache.tcg import Match, NodeRef, StateChain, longest_prefix_match, state_chain

from .tasks import TaskHandle, task_handle

_HIT_SQL = """
WITH hit AS (
    UPDATE cache_node SET hit_count = hit_count + 1, last_hit_at = now()
    WHERE task_id = %(task)s AND anchor_key = %(anchor)s AND call_digest = %(digest)s AND %(cacheable)s
    RETURNING id, result_json, exec_ms
), seen AS (
    SELECT count(*) AS n FROM cache_node
    WHERE task_id = %(task)s AND anchor_key = %(anchor)s AND call_digest = %(digest)s
), stat AS (
    INSERT INTO cache_toolstat (task_id, epoch, tool, calls, hits, oracle_hits, executions, executed_ms, saved_ms)
    SELECT %(task)s, %(epoch)s, %(tool)s, 1, (SELECT count(*) FROM hit), (SELECT n FROM seen), 0, 0,
           coalesce((SELECT sum(exec_ms) FROM hit), 0)
    ON CONFLICT (task_id, epoch, tool) DO UPDATE SET
        calls = cache_toolstat.calls + 1,
        hits = cache_toolstat.hits + EXCLUDED.hits,
        oracle_hits = cache_toolstat.oracle_hits + EXCLUDED.oracle_hits,
        saved_ms = cache_toolstat.saved_ms + EXCLUDED.saved_ms
){rollout}
SELECT id, result_json FROM hit
"""

_ROLLOUT_SQL = """, roll AS (
    INSERT INTO cache_rollout (task_id, rollout_id, epoch, calls, hits, history, started_at)
    VALUES (%(task)s, %(rollout)s, %(epoch)s, 1, (SELECT count(*) FROM hit), '[]', now())
    ON CONFLICT (task_id, rollout_id) DO UPDATE SET
        calls = cache_rollout.calls + 1, hits = cache_rollout.hits + EXCLUDED.hits, epoch = EXCLUDED.epoch
)"""

HIT_SQL = _HIT_SQL.replace("{rollout}", "")
HIT_SQL_WITH_ROLLOUT = _HIT_SQL.replace("{rollout}", _ROLLOUT_SQL)

# The chain's state-changing nodes that exist, each with its live snapshot if it has one.
LPM_SQL = """
SELECT n.id, n.state_key, n.depth, n.cum_exec_ms, s.id, s.ref
FROM cache_node n LEFT JOIN cache_snapshot s ON s.node_id = n.id AND s.status = 'live'
WHERE n.task_id = %s AND n.mutates AND n.state_key = ANY(%s)
"""

# A lease is only granted on a snapshot that is still live (FOR SHARE orders it against eviction).
LEASE_SQL = """
INSERT INTO cache_lease (id, snapshot_id, rollout_id, created_at, expires_at)
SELECT gen_random_uuid(), s.id, %s, now(), %s FROM cache_snapshot s
WHERE s.id = %s AND s.status = 'live' FOR SHARE
RETURNING id
"""


@dataclass(frozen=True, slots=True)
class LookupHit:
    node_id: int
    result_json: str


@dataclass(frozen=True, slots=True)
class LookupMiss:
    match: Match
    lease_id: str | None
    full_replay: tuple  # every state-changing call of the history, for a fresh sandbox


def tcg_lookup(*, task_id: str, context: CallContext) -> LookupHit | LookupMiss:
    task = task_handle(task_id=task_id)
    task.check_fingerprint(context.env_fingerprint)
    chain = task_chain(task, context)
    last = chain.steps[-1]
    params = {
        "task": task.task_id,
        "anchor": last.anchor,
        "digest": last.digest,
        "cacheable": task.policy.for_tool(last.call.tool).cacheable,
        "epoch": context.epoch,
        "tool": last.call.tool,
        "rollout": context.rollout_id,
    }
    with connection.cursor() as cursor:
        cursor.execute(HIT_SQL_WITH_ROLLOUT if context.rollout_id else HIT_SQL, params)
        row = cursor.fetchone()
    if row is not None:
        return LookupHit(node_id=row[0], result_json=row[1])
    history = StateChain(root=chain.root, steps=chain.steps[:-1])
    match = longest_prefix_match(history, existing_writes(task.task_id, history))
    lease_id = None
    if match.resume is not None:
        lease_id = lease_grant(snapshot_id=match.resume.snapshot_id, rollout_id=context.rollout_id)
        if lease_id is None:  # evicted between the match and the lease: start fresh
            match = Match(match.matched, match.node, None, tuple(step.call for step in history.writes))
    return LookupMiss(match=match, lease_id=lease_id, full_replay=tuple(step.call for step in history.writes))


def task_chain(task: TaskHandle, context: CallContext) -> StateChain:
    return state_chain(task.fingerprint, [*context.history, context.call], task.policy)


def existing_writes(task_id: str, chain: StateChain) -> dict[str, NodeRef]:
    keys = [step.state_key for step in chain.writes]
    if not keys:
        return {}
    with connection.cursor() as cursor:
        cursor.execute(LPM_SQL, [task_id, keys])
        rows = cursor.fetchall()
    return {
        state_key: NodeRef(node_id=node_id, state_key=state_key, depth=depth, cum_exec_ms=cum,
                           snapshot_id=snapshot_id, snapshot_ref=ref)
        for node_id, state_key, depth, cum, snapshot_id, ref in rows
    }


def lease_grant(*, snapshot_id: int, rollout_id: str) -> str | None:
    expires = timezone.now() + timedelta(seconds=settings.TVCACHE["LEASE_TTL_S"])
    with connection.cursor() as cursor:
        cursor.execute(LEASE_SQL, [rollout_id, expires, snapshot_id])
        row = cursor.fetchone()
    return str(row[0]) if row else None
