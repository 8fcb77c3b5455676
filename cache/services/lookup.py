"""Lookup: one statement, whatever the history length: the indexed read of the node for a hit,
and on a miss, in the same round trip, the longest-prefix match over the history's state keys.
A hit this process served lately, under the task's current version, is served again with none
(hitcache.py). Counters are batched (ledger.py).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import connection
from django.utils import timezone

from cache import ledger
from cache.inputs import HISTORY_MEMO_ENTRIES
from cache.models import Node
from cache.notfound import unknown_task
from cache.prepared import prepared_cursor
from cache.tcg import (
    CatchUp,
    Match,
    NodeRef,
    StateChain,
    ToolCall,
    call_digest,
    catch_up,
    chain_extended,
    longest_prefix_match,
    state_chain,
)
from cache.tcg.records import CallContext, CallRecord, RecordedState
from cache.tcg.snapshots import snapshot_after_ms
from core.ttl import RecentMemo

from .hitcache import CachedHit, TaskStamp, hit_cache
from .snapshots import backend_costs
from .tasks import TaskHandle, cached_task_handle, task_handle

# The task's current version (a cached handle may be outdated), the node under (anchor, digest)
# and, only when that is no hit (CASE evaluates the subquery lazily), the history's state-changing
# nodes that exist, each with its live snapshot if it has one: [[id, state_key, depth, cum_exec_ms,
# [snapshot_id, ref] or null], ...]. The snapshot is a subquery per node, so that it is an index
# probe whatever the table statistics say: with none (autovacuum off, a new table) a join scanned
# every live snapshot per node, 2.4 ms instead of 0.04 ms for 12 nodes and 361 snapshots.
#
# Client-mode single flight rides in the same round trip (`claim`): on a miss of a cacheable call
# the rollout takes the call's claim unless another rollout holds it and it has not lapsed (that
# rollout's own retry gets it back); the last column says whether it got it. No claim once the
# node exists (a rollout that missed just before a record sees the hit on its next lookup), nor
# with an outdated handle (its keys may be stale: the lookup is run again). The CTE's insert sees
# the same snapshot as the read, and ON CONFLICT the latest claim. A claim is coordination with
# a TTL, like a lease (LEASE_SQL): its commit does not wait for the WAL to reach the disk. A
# PostgreSQL crash may lose the claims of its last few hundred ms; their calls may then run twice.
# Counters go to the in-process ledger (ledger.py), not to this query.
#
# A divergent node (the determinism audit found its call gives another result in the same state)
# is not served: it answers like the node of an uncacheable tool (a miss with its match, no claim).
# Neither is a node below a divergent state-changing node (`tainted`): the state after such a call
# is not a function of the history, so a rollout that ran it itself may be anywhere. The probe
# is in the statement only for a task that has such a node (READ_SQL_BELOW_DIVERGENT; its handle
# says so, and marking one moves the task's version): elsewhere it costs nothing, and where it is
# it goes through an index of divergent state-changing nodes only (node_divergent_state; ~10 us a
# hit). The miss's match keeps the nodes below: their snapshots hold the state the rollouts that
# hit the call saw.
# A claim on executing (task, anchor, call): taken when free, lapsed, or already this holder's,
# and only while the node does not exist. Client-mode lookups take it in their own statement
# (READ_SQL); single flight (flight.py) on its own.
CLAIM_INSERT = """
    INSERT INTO cache_claim AS c (task_id, anchor_key, call_digest, holder, expires_at)
    SELECT t.id, %(anchor)s::varchar, %(digest)s::varchar, %(holder)s::varchar,
           clock_timestamp() + %(ttl)s::float8 * interval '1 second'
    FROM cache_task t
    WHERE {condition} AND t.id = %(task)s
      AND set_config('synchronous_commit', 'off', true) IS NOT NULL
      AND NOT EXISTS (SELECT FROM cache_node n
                      WHERE n.task_id = t.id AND n.anchor_key = decode(%(anchor)s, 'hex')
                        AND n.call_digest = decode(%(digest)s, 'hex'))
    ON CONFLICT (task_id, anchor_key, call_digest) DO UPDATE SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at
    WHERE c.expires_at < clock_timestamp() OR c.holder = EXCLUDED.holder
    RETURNING true AS granted"""

# Giving a claim up once its execution failed: the next rollout leads now, not once it lapses. A
# claim whose node was recorded stays until it lapses (record.py: a rollout that missed just
# before the record waits for its next lookup's hit rather than executing the call again).
CLAIM_RELEASE_SQL = """
DELETE FROM cache_claim c WHERE c.task_id = %(task)s AND c.anchor_key = %(anchor)s AND c.call_digest = %(digest)s
  AND c.holder = %(holder)s
  AND NOT EXISTS (SELECT FROM cache_node n WHERE n.task_id = c.task_id AND n.anchor_key = decode(c.anchor_key, 'hex')
                                              AND n.call_digest = decode(c.call_digest, 'hex'))"""

# The history's state-changing nodes that exist, each with its live snapshot if it has one (and
# whether that keeps processes) and the processes its state keeps running. A state-keyed hit's
# node (`merged_from`) holds the state of the node it merged with: that node's snapshot stands in
# for it. Every node of the history: what a catch-up weighs (history_catch_up). An index probe per
# key whatever the statistics say (`OFFSET 0` keeps the subquery from being flattened): with a task
# newer than them, the planner read every state-changing node of the task and filtered the keys.
_WRITES_SQL = """SELECT json_agg(json_build_array(w.id, encode(w.state_key, 'hex'), w.depth, w.cum_exec_ms, (
               SELECT json_build_array(s.id, s.ref, s.keeps_processes) FROM cache_snapshot s
               WHERE s.node_id = coalesce(w.merged_from, w.id) AND s.status = 'live'), w.live_processes))
           FROM unnest(string_to_array(%(keys)s, ',')) AS k
           CROSS JOIN LATERAL (SELECT * FROM cache_node w
                               WHERE w.task_id = %(task)s AND w.mutates AND w.state_key = decode(k, 'hex') OFFSET 0) w"""

# What a miss needs of them (tcg.longest_prefix_match), read without visiting the whole history,
# so that a miss costs the same after 10 calls or 1,000: the deepest that exists, its keys probed
# from the deepest up (`keys` comes deepest first: a rollout's previous call recorded it, one probe),
# and the nearest above it whose snapshot can stand in for its state (NodeRef.resumable), reached by
# parent links (a node's parent is its history's previous state-changing node: the state keys
# chain), at most `walk` of them up and none in a task without a live snapshot (its counters). Past
# that the miss starts from the root, which is slower and as exact; the snapshot policy keeps
# snapshots closer than that along a busy path. Same rows as _WRITES_SQL, two at most.
_SNAPSHOT_OF = """LEFT JOIN LATERAL (
        SELECT json_build_array(s.id, s.ref, s.keeps_processes) AS snapshot, s.keeps_processes AS keeps
        FROM cache_snapshot s WHERE s.node_id = coalesce(n.merged_from, n.id) AND s.status = 'live') s ON true"""
ANY_LIVE_SNAPSHOT = "EXISTS (SELECT FROM cache_snapshottotal t WHERE t.task_id = %(task)s AND t.live > 0)"
_RESUMABLE = "s.snapshot IS NOT NULL AND (coalesce(n.live_processes, 0) = 0 OR s.keeps)"
# What the answer needs of each node walked, carried by the walk: a join of the walk with the nodes
# at the end would be planned on the table's statistics (with stale ones, a scan of every node).
_WALKED = "n.state_key, n.depth, n.cum_exec_ms, n.live_processes"
_PATH_SQL = f"""WITH RECURSIVE keys AS MATERIALIZED (
    SELECT string_to_array(%(keys)s, ',') AS a
), probe(i, id) AS (
    SELECT 0, NULL::bigint
    UNION ALL
    SELECT probe.i + 1, (SELECT n.id FROM cache_node n WHERE n.task_id = %(task)s AND n.mutates
                                                          AND n.state_key = decode(keys.a[probe.i + 1], 'hex'))
    FROM probe, keys WHERE probe.id IS NULL AND probe.i < coalesce(cardinality(keys.a), 0)
), walk(id, parent_id, steps, snapshot, resumable, state_key, depth, cum_exec_ms, live_processes) AS (
    SELECT n.id, n.parent_id, 0, s.snapshot, {_RESUMABLE}, {_WALKED}
    FROM probe JOIN cache_node n ON n.id = probe.id
    {_SNAPSHOT_OF}
    UNION ALL
    SELECT n.id, n.parent_id, walk.steps + 1, s.snapshot, {_RESUMABLE}, {_WALKED}
    FROM walk JOIN cache_node n ON n.id = walk.parent_id
    {_SNAPSHOT_OF}
    WHERE NOT walk.resumable AND walk.steps < %(walk)s AND {ANY_LIVE_SNAPSHOT}
)
SELECT json_agg(json_build_array(id, encode(state_key, 'hex'), depth, cum_exec_ms, snapshot, live_processes))
FROM walk WHERE steps = 0 OR resumable"""

# How many parent links a miss walks up from the deepest node of its history for a snapshot to
# start from (_PATH_SQL), and a record for the nearest snapshot's cost (record.py).
SNAPSHOT_WALK = 128

# State-keyed lookup (docs/design/state-match.md), in the lookup's statement, evaluated only on a
# miss by history of a cacheable call (the CASE is lazy), from a state `p` with a verified
# fingerprint: a node of the same call under another state `q` whose fingerprint (contents, modes,
# owners, the order of file times by the nanosecond and by the second, the shell session, the live
# processes) is p's: three index probes, in that order whatever the table's statistics say (`OFFSET 0`
# keeps the planner from flattening the subqueries: with stale statistics it started from every
# state-changing node of the task, and found p through the fingerprints' index, scanning the task).
# Neither state, nor the node, divergent; the fingerprint not stopped by the audit (cache_mergeban).
# An executed node first (a merged one serves the same bytes). A state recorded without the order of
# its times merges only where its backend's tools see no file times (folders, SQLite: their shape is
# their full fingerprint); a merged node's is one (record.py).
# `{clean}`: in a task with a divergent state-changing node, neither history may pass one (a state
# below one is not a function of its history, so its fingerprint vouches for nothing).
_STATE_PROBE_SQL = """(
WITH p AS MATERIALIZED (
    SELECT p.id, p.state_fingerprint, p.state_order
    FROM (SELECT * FROM cache_node p WHERE p.task_id = %(task)s AND p.mutates AND p.state_key = decode(%(anchor)s, 'hex')
          OFFSET 0) p
    WHERE p.state_fingerprint <> '' AND (p.state_order <> '' OR p.state_shape = p.state_fingerprint) AND NOT p.divergent
      AND NOT EXISTS (SELECT FROM cache_mergeban b WHERE b.task_id = p.task_id AND b.fingerprint = p.state_fingerprint)
)
SELECT json_build_array(m.id, m.result_json, m.exec_ms, m.mutates, m.state_fingerprint, m.state_shape,
                        m.live_processes, coalesce(m.merged_from, m.id))
FROM p
CROSS JOIN LATERAL (
    SELECT q.id, q.state_key, q.parent_id FROM cache_node q
    WHERE q.task_id = %(task)s AND q.mutates AND q.state_fingerprint = p.state_fingerprint AND q.state_fingerprint <> ''
      AND q.state_order = p.state_order AND q.id <> p.id AND NOT q.divergent OFFSET 0) q
CROSS JOIN LATERAL (
    SELECT m.* FROM cache_node m
    WHERE m.task_id = %(task)s AND m.anchor_key = q.state_key AND m.call_digest = decode(%(digest)s, 'hex')
      AND NOT m.divergent OFFSET 0) m
WHERE true {clean}
ORDER BY m.merged_from IS NOT NULL, m.id
LIMIT 1)"""
_STATE_PROBE = _STATE_PROBE_SQL.format(clean="")
_STATE_PROBE_CLEAN = _STATE_PROBE_SQL.format(
    clean="""AND NOT EXISTS (SELECT FROM cache_node d WHERE d.task_id = %(task)s AND d.mutates AND d.divergent
                     AND d.state_key = ANY(ARRAY(SELECT decode(k, 'hex') FROM unnest(string_to_array(%(keys)s, ',')) AS k)))
  AND NOT EXISTS (WITH RECURSIVE up(parent_id, divergent) AS (
                      SELECT q.parent_id, false
                      UNION ALL
                      SELECT n.parent_id, n.divergent FROM cache_node n JOIN up ON n.id = up.parent_id)
                  SELECT FROM up WHERE divergent)"""
)

_READ_SQL = (
    """
WITH claimed AS ("""
    + CLAIM_INSERT.format(condition="%(claim)s AND %(cacheable)s AND t.version = %(version)s")
    + """
)
SELECT t.version, t.created_at, n.id, n.result_json, n.exec_ms, n.mutates, n.divergent OR {tainted},
       CASE WHEN n.id IS NULL OR n.divergent OR {tainted} OR NOT %(cacheable)s THEN ("""
    + _PATH_SQL
    + """) END,
       CASE WHEN n.id IS NULL AND %(cacheable)s THEN {probe} END,
       EXISTS (SELECT FROM claimed)
FROM cache_task t
LEFT JOIN cache_node n ON n.task_id = t.id AND n.anchor_key = decode(%(anchor)s, 'hex')
                      AND n.call_digest = decode(%(digest)s, 'hex')
{below}
WHERE t.id = %(task)s
"""
)
READ_SQL = _READ_SQL.format(tainted="false", below="", probe=_STATE_PROBE)
READ_SQL_BELOW_DIVERGENT = _READ_SQL.format(
    tainted="x.tainted",
    probe=_STATE_PROBE_CLEAN,
    below="""CROSS JOIN LATERAL (
    SELECT CASE WHEN n.id IS NULL THEN false ELSE EXISTS (
        SELECT FROM cache_node d WHERE d.task_id = t.id AND d.mutates AND d.divergent
                                   AND d.state_key = ANY(ARRAY(SELECT decode(k, 'hex') FROM unnest(string_to_array(%(keys)s, ',')) AS k))) END AS tainted) x""",
)

# The task's stamp alone, to renew this process's lease on it when a cached hit waits (hitcache.py).
STAMP_SQL = "SELECT version, created_at FROM cache_task WHERE id = %s"

# A lease is only granted on a snapshot that is still live (FOR SHARE orders it against eviction).
# Its commit does not wait for the WAL to reach the disk (synchronous_commit off for this one
# statement's transaction): a lease is coordination with a TTL, not data, and that wait sits on a
# miss's critical path (docs/design/exactness.md has the figures). A PostgreSQL crash can lose the leases of its last
# few hundred ms; such a snapshot may then be evicted while its rollout forks it, which fails
# that call like any fork of a vanished snapshot and never returns a wrong result.
LEASE_SQL = """
INSERT INTO cache_lease (id, snapshot_id, rollout_id, created_at, expires_at)
SELECT gen_random_uuid(), s.id, %s, now(), %s FROM cache_snapshot s
WHERE s.id = %s AND s.status = 'live' AND set_config('synchronous_commit', 'off', true) IS NOT NULL
FOR SHARE
RETURNING id
"""


GRANTED, IN_FLIGHT = "granted", "in_flight"
log = logging.getLogger("tvcache.cache")

# State chains this process computed lately: (task, stamp, history digest) -> the history's chain
# (task_chain). 8,192 chains of 32 calls take about 2 MB (their steps are shared).
_chains: RecentMemo[tuple[str, TaskStamp, bytes], StateChain] = RecentMemo(HISTORY_MEMO_ENTRIES)


@dataclass(frozen=True, slots=True)
class LookupHit:
    node_id: int
    result_json: str
    exec_ms: float
    mutates: bool  # False: the call left the state as it was (declared or observed read-only)
    audit: bool = False  # sampled for the determinism audit (the task's audit_rate)
    via_state: bool = False  # a state-keyed hit: the node was merged just now (docs/design/state-match.md)


@dataclass(frozen=True, slots=True)
class LookupMiss:
    match: Match
    lease_id: str | None
    full_replay: tuple  # every state-changing call of the history, for a fresh sandbox
    anchor_key: str  # where the call's node will hang: (task, anchor_key, call_digest) is its key
    call_digest: str
    seen: bool  # the node exists (a call of a tool that is not cacheable)
    # Asked for a claim: GRANTED (execute and record it) or IN_FLIGHT (another rollout is
    # executing this call in this state: look up again shortly; nothing was counted or leased).
    claim: str | None = None
    snapshot_after_ms: float | None = None  # (_snapshot_after_ms)
    # The call was seen before from a state with the same verified fingerprint (the state oracle's
    # hit), and not served from it: the task matches by history (docs/design/state-match.md).
    state_seen: bool = False


def tcg_lookup(
    *, task_id: str, context: CallContext, count: bool = True, claim: bool = False, resume: bool = True
) -> LookupHit | LookupMiss:
    """Hit or miss. With count=False the caller counts the lookup itself (`lookup_count`), once
    it knows how the call was served (tool-server mode may wait for a concurrent identical miss).
    With `claim`, a miss of a cacheable call also takes the call's claim for the context's rollout
    (client-mode single flight, see READ_SQL). With resume=False (the caller's sandbox follows the
    history) a miss offers no snapshot to fork, and so leases none: one statement, not two."""
    # The task handle comes from this process's cache; the statement checks its version, and a
    # stale handle (the task changed) is re-read and the statement run again with the new keys.
    # A hit this process served lately under the task's current version needs no statement at all.
    task = task_handle(task_id=task_id, cached=True)
    chain = _chain(task, context)
    last = chain.steps[-1]
    cached = _hit_cached(task, last.anchor, last.digest)
    if cached is not None:
        return _hit(task, context, cached, count)
    row = _exact_read(task, chain, context, claim)
    if row is not None and (row[0], row[1]) != task.stamp:
        task = task_handle(task_id=task_id)
        chain = _chain(task, context)
        last = chain.steps[-1]
        row = _exact_read(task, chain, context, claim)
    if row is None:
        raise unknown_task(task_id)
    version, created_at, node_id, result_json, exec_ms, mutates, divergent, writes, merged, granted = row
    cacheable = task.policy.for_tool(context.call.tool).cacheable
    hit = node_id is not None and cacheable and not divergent
    claimed = None
    if claim and node_id is None and cacheable:
        claimed = GRANTED if granted else IN_FLIGHT
        if claimed == IN_FLIGHT:
            return LookupMiss(
                match=Match(0, None, None, ()),
                lease_id=None,
                full_replay=(),
                anchor_key=last.anchor,
                call_digest=last.digest,
                seen=False,
                claim=IN_FLIGHT,
            )
    if hit:
        answer = CachedHit(node_id, result_json, exec_ms, mutates)
        if (version, created_at) == task.stamp:
            _hit_keep(task, last.anchor, last.digest, answer)
        return _hit(task, context, answer, count)
    history = StateChain(root=chain.root, steps=chain.steps[:-1])
    refs = _node_refs(writes or ())
    if merged is not None and task.match == "state":
        answer = _state_merged(task, context, merged)
        if answer is not None:
            return _hit(task, context, answer, count, via_state=True)
    if count:
        lookup_count(
            task_id=task.task_id,
            context=context,
            node_id=node_id,
            hit=False,
            seen=node_id is not None,
            state_seen=node_id is not None or merged is not None,
            saved_ms=exec_ms or 0.0,
        )
    match = longest_prefix_match(history, refs)
    full_replay = tuple(step.call for step in history.writes)
    snapshot_after = _snapshot_after_ms(task, match, len(context.history)) if node_id is None else None
    match, lease_id = _leased(match, full_replay, context.rollout_id if resume else None)
    return LookupMiss(
        match=match,
        lease_id=lease_id,
        full_replay=full_replay,
        anchor_key=last.anchor,
        call_digest=last.digest,
        seen=node_id is not None,
        claim=claimed,
        snapshot_after_ms=snapshot_after,
        state_seen=merged is not None,
    )


def tcg_lookup_in_memory(*, task_id: str, context: CallContext, admit: Callable[[], None]) -> LookupHit | None:
    """The hit this process's cache serves for the context with no statement and no wait: the
    task's handle is cached, this process holds a lease on the task's stamp (hitcache.py) and the
    handle and the entry carry it. None otherwise: `tcg_lookup` then answers, the same way.
    `admit` runs once the hit is certain, before it is counted (a refusal counts nothing). Cheap
    enough for the event loop, which then answers without a hop to a lane's thread."""
    task = cached_task_handle(task_id)
    if task is None:
        return None
    last = _chain(task, context).steps[-1]
    cached = _hit_cached(task, last.anchor, last.digest, renew=False)
    if cached is None:
        return None
    if hit_cache().renewal_due(task_id):
        _renewer.submit(_lease_renewed, task_id)
    admit()
    return _hit(task, context, cached, True)


# Renews leases before they lapse, off the event loop (tcg_lookup_in_memory). Its thread keeps its
# connection, as a lane's threads do: taking one from the pool for each renewal (a health check,
# the statement prepared again) let leases lapse under a busy event loop.
_renewer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tvcache-lease")


def _lease_renewed(task_id: str) -> None:
    try:
        _stamp_read(task_id)
    except Exception:
        log.warning("renewing the hit cache's lease on %s failed", task_id, exc_info=True)
    finally:
        hit_cache().renewal_done(task_id)


def _snapshot_after_ms(task: TaskHandle, match: Match, history_length: int) -> float | None:
    """What the record of this miss will decide about a snapshot, as far as the graph tells now:
    one is wanted if the call changes the state and runs longer than this (record.py: replaying
    the path since its nearest snapshot would cost more than taking and restoring one). None when
    none will be (no budget, or the history is not all in the graph). A client that starts
    freezing its environment as soon as the call returns, rather than once the record answers,
    keeps the freeze off its next call's path; the record's answer stays the one that counts."""
    if task.sandbox_budget <= 0 or match.matched != history_length:
        return None
    since = (match.node.cum_exec_ms if match.node else 0.0) - (match.resume.cum_exec_ms if match.resume else 0.0)
    return snapshot_after_ms(replay_cost_ms=since, costs=backend_costs(task.backend))


def claim_release(*, task_id: str, context: CallContext) -> bool:
    """Give up the rollout's claim on the call (its execution failed): the next rollout that
    looks it up executes it now rather than once the claim lapses. False if it held none."""
    task = task_handle(task_id=task_id, cached=True)
    last = task_chain(task, context).steps[-1]
    with connection.cursor() as cursor:
        cursor.execute(
            CLAIM_RELEASE_SQL,
            {"task": task.task_id, "anchor": last.anchor, "digest": last.digest, "holder": context.rollout_id},
        )
        return cursor.rowcount > 0


def lookup_count(
    *,
    task_id: str,
    context: CallContext,
    node_id: int | None,
    hit: bool,
    seen: bool,
    saved_ms: float,
    state_seen: bool | None = None,
    via_state: bool = False,
) -> None:
    """Count a lookup: calls, hits, the oracles' hits (`seen`: the call was executed before after
    the same history; `state_seen`, by default `seen`: or from a state with the same verified
    fingerprint), the state-keyed hits (`via_state`) and the time a hit saved."""
    call = context.call
    ledger.lookup_add(
        task_id=task_id,
        epoch=context.epoch,
        tool=call.tool,
        rollout_id=context.rollout_id,
        node_id=node_id,
        hit=hit,
        seen=seen,
        state_seen=seen if state_seen is None else state_seen,
        via_state=via_state,
        saved_ms=saved_ms,
        applied=len(context.history),
        trace=context.trace,
    )


def hit_count(*, task_id: str, context: CallContext, hit: LookupHit) -> None:
    """Count a hit `tcg_lookup(count=False)` answered: a state-keyed one is the state oracle's hit,
    not the longest-prefix oracle's."""
    lookup_count(
        task_id=task_id,
        context=context,
        node_id=hit.node_id,
        hit=True,
        seen=not hit.via_state,
        state_seen=True,
        via_state=hit.via_state,
        saved_ms=hit.exec_ms,
    )


def _hit(task: TaskHandle, context: CallContext, answer: CachedHit, count: bool, via_state: bool = False) -> LookupHit:
    """A hit's answer, counted (unless the caller counts it: `hit_count`) and sampled for the
    audit, whether the database or this process's cache served it. A state-keyed hit
    (`via_state`) is sampled at least at TVCACHE_STATE_AUDIT_RATE (unless the task's audit is off)."""
    # Sampled here, in process: the audit costs the hit path no statement.
    rate = max(task.audit_rate, settings.TVCACHE["STATE_AUDIT_RATE"]) if via_state else task.audit_rate
    audit = task.audit_rate > 0.0 and random.random() < rate
    hit = LookupHit(
        node_id=answer.node_id,
        result_json=answer.result_json,
        exec_ms=answer.exec_ms,
        mutates=answer.mutates,
        audit=audit,
        via_state=via_state,
    )
    if count:
        hit_count(task_id=task.task_id, context=context, hit=hit)
    return hit


def _state_merged(task: TaskHandle, context: CallContext, found: tuple) -> CachedHit | None:
    """A state-keyed hit: the node found, recorded again under the rollout's own history (its
    result's bytes and the state it left, with `merged_from`), so that the rollout's later calls
    look up from there as from any state. None when a node under that history came first (a
    record, or another merge, raced this one): the lookup then answers as a miss."""
    from .record import MergedNode, node_record  # record.py builds on this module

    _, result_json, exec_ms, mutates, full, shape, processes, source = found  # (_STATE_PROBE_SQL)
    outcome = node_record(
        task_id=task.task_id,
        record=CallRecord(context, None, exec_ms, mutated=mutates),
        # Not the executed node's order of times (nor its times): a replay of the call along this
        # history runs later than the files before it, in a whole second of its own, so it is
        # checked by its shape; a fork of that node's snapshot, by the full fingerprint. Without
        # an order the state merges with no other (STATE_PROBE_SQL).
        state=RecordedState(full, shape, "", None, processes) if mutates else RecordedState(),
        merged=MergedNode(node_id=source, result_json=result_json),
        evicted=False,
    )
    if not outcome.created:
        return None
    return CachedHit(outcome.node_id, result_json, exec_ms, outcome.mutates)


def _hit_cached(task: TaskHandle, anchor: str, digest: str, *, renew: bool = True) -> CachedHit | None:
    """The hit this process keeps under (task, anchor, digest), if it holds a lease on the task's
    current stamp and the entry and the handle (whose keys found it) carry that stamp. A lapsed
    lease is renewed by reading the task's stamp, only when an entry waits (hitcache.py), and
    only with `renew`."""
    cache = hit_cache()
    if not cache.enabled:
        return None
    key = (task.task_id, anchor, digest)
    stamp = cache.leased(task.task_id)
    if stamp is None:
        if not renew or not cache.waiting(key):
            return None
        stamp = _stamp_read(task.task_id)
    if stamp is None or stamp != task.stamp:
        return None  # the handle is outdated (or the task gone): the statement says what to do
    return cache.get(key, stamp)


def _hit_keep(task: TaskHandle, anchor: str, digest: str, answer: CachedHit) -> None:
    cache = hit_cache()
    if cache.enabled:
        cache.put((task.task_id, anchor, digest), task.stamp, answer)


def _stamp_read(task_id: str) -> TaskStamp | None:
    sent_at = time.monotonic()  # before the statement is sent: its snapshot is taken after
    with prepared_cursor() as cursor:
        cursor.execute(STAMP_SQL, [task_id])
        row = cursor.fetchone()
    if row is None:
        return None
    hit_cache().lease_renew(task_id, (row[0], row[1]), sent_at)
    return row[0], row[1]


def _chain(task: TaskHandle, context: CallContext) -> StateChain:
    task.check_fingerprint(context.env_fingerprint)
    return task_chain(task, context)


def _exact_read(task: TaskHandle, chain: StateChain, context: CallContext, claim: bool) -> tuple | None:
    """The lookup statement's row; it renews this process's lease on the task's stamp."""
    last = chain.steps[-1]
    params = {
        "task": task.task_id,
        "version": task.version,
        "anchor": last.anchor,
        "digest": last.digest,
        "cacheable": task.policy.for_tool(context.call.tool).cacheable,
        "claim": claim,
        "holder": context.rollout_id or "",
        "ttl": settings.TVCACHE["CLAIM_TTL_S"],
        # One comma-joined text, split by the server: adapting a list costs 0.1 ms of Python. The
        # deepest first (_PATH_SQL).
        "keys": ",".join(step.state_key for step in reversed(chain.steps[:-1]) if step.mutates),
        "walk": SNAPSHOT_WALK if task.sandbox_budget > 0 else 0,
    }
    sent_at = time.monotonic()
    with prepared_cursor() as cursor:
        cursor.execute(READ_SQL_BELOW_DIVERGENT if task.divergent_writes else READ_SQL, params)
        row = cursor.fetchone()
    cache = hit_cache()
    if row is not None and cache.enabled:
        cache.lease_renew(task.task_id, (row[0], row[1]), sent_at)
    return row


def history_catch_up(*, task_id: str, history: tuple[ToolCall, ...], applied: int) -> CatchUp | None:
    """How a sandbox that applied the first `applied` calls of a rollout's history best catches up
    with all of it: by replaying what it lacks, or by forking a snapshot past its state (tcg.catch_up)."""
    task = task_handle(task_id=task_id, cached=True)
    chain, refs = _history_states(task, history)
    return catch_up(chain, refs, applied, backend_costs(task.backend).restore_ms)


def history_resume(*, task_id: str, history: tuple[ToolCall, ...], rollout_id: str) -> LookupMiss:
    """What a sandbox for a rollout standing at the end of `history` starts from, as a miss after
    it would: the nearest live snapshot along it (leased to the rollout) and the calls to replay
    on top (a branch's sandbox is made this way before its first call)."""
    chain, refs = _history_states(task_handle(task_id=task_id, cached=True), history)
    full_replay = tuple(step.call for step in chain.writes)
    match, lease_id = _leased(longest_prefix_match(chain, refs), full_replay, rollout_id)
    return LookupMiss(match, lease_id, full_replay, anchor_key="", call_digest="", seen=False)


def _history_states(task: TaskHandle, history: tuple[ToolCall, ...]) -> tuple[StateChain, dict[str, NodeRef]]:
    """The history's state chain and the recorded states along it, with their live snapshots."""
    chain = state_chain(task.fingerprint, history, task.policy)
    with connection.cursor() as cursor:
        cursor.execute(
            _WRITES_SQL,
            {"task": task.task_id, "keys": ",".join(step.state_key for step in chain.writes)},
        )
        rows = cursor.fetchone()[0]
    return chain, _node_refs(rows or ())


def _leased(match: Match, full_replay: tuple, rollout_id: str | None) -> tuple[Match, str | None]:
    """The match with a lease on its snapshot for `rollout_id` (None: no lease wanted); without
    a lease (not wanted, or the snapshot evicted since the match) the match starts fresh."""
    if match.resume is None:
        return match, None
    lease_id = (
        lease_grant(snapshot_id=match.resume.snapshot_id, rollout_id=rollout_id) if rollout_id is not None else None
    )
    if lease_id is None:
        return Match(match.matched, match.node, None, full_replay), None
    return match, lease_id


def task_chain(task: TaskHandle, context: CallContext) -> StateChain:
    """The state chain of the context's history and call. The history's comes from this process's
    memo when a lookup or record of the history computed it (typically the rollout's previous
    call, whose chain is kept under the digest of the history after it): then no call of the
    history is hashed again; the chain with the call is kept too (under the digest of the history
    after it), which this call's record and the rollout's next call find. Memo entries are the task's at one stamp: a version move (a changed
    policy) or a task made again never finds them."""
    if not context.history_digest:
        return state_chain(task.fingerprint, [*context.history, context.call], task.policy)
    done = _chains.get((task.task_id, task.stamp, context.next_digest))  # this call's lookup's, for its record
    if done is not None:
        return done
    history = _chains.get((task.task_id, task.stamp, context.history_digest))
    if history is None:
        history = state_chain(task.fingerprint, context.history, task.policy)
        _chains.put((task.task_id, task.stamp, context.history_digest), history)
    chain = chain_extended(history, context.call, task.policy)
    if context.next_digest:
        _chains.put((task.task_id, task.stamp, context.next_digest), chain)
    return chain


def replay_file_times(
    *, task_id: str, context: CallContext, calls: Sequence[ToolCall]
) -> list[Mapping[str, int] | None]:
    """For a replay of `calls`, the last state-changing calls of the context's history: the file
    times each left when it first ran (Node.file_times), in order; None where they were not kept
    (or the call was recorded as read-only: a replay of it that writes is not the live run)."""
    if not calls:
        return []
    task = task_handle(task_id=task_id)
    writes = state_chain(task.fingerprint, context.history, task.policy).writes
    tail = writes[len(writes) - len(calls) :] if len(calls) <= len(writes) else []
    if len(tail) != len(calls) or any(step.digest != call_digest(call) for step, call in zip(tail, calls)):
        return [None for _ in calls]  # not the history's last writes: nothing known to restore
    times = dict(
        Node.objects.filter(task_id=task_id, mutates=True, state_key__in=[s.state_key for s in tail]).values_list(
            "state_key", "file_times"
        )
    )
    return [times.get(step.state_key) for step in tail]


def _node_refs(rows) -> dict[str, NodeRef]:
    return {
        state_key: NodeRef(
            node_id=node_id,
            state_key=state_key,
            depth=depth,
            cum_exec_ms=cum,
            snapshot_id=snapshot[0] if snapshot else None,
            snapshot_ref=snapshot[1] if snapshot else None,
            processes=processes or 0,
            snapshot_keeps_processes=bool(snapshot and snapshot[2]),
        )
        for node_id, state_key, depth, cum, snapshot, processes in rows
    }


def lease_grant(*, snapshot_id: int, rollout_id: str) -> str | None:
    """A lease on the snapshot if it is still live. Called in autocommit, as lookups run: in a
    transaction block, LEASE_SQL's asynchronous commit would cover the whole block."""
    expires = timezone.now() + timedelta(seconds=settings.TVCACHE["LEASE_TTL_S"])
    with connection.cursor() as cursor:
        cursor.execute(LEASE_SQL, [rollout_id, expires, snapshot_id])
        row = cursor.fetchone()
    return str(row[0]) if row else None
