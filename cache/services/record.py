"""Record: insert-or-get of a node under its unique key, safe under concurrent rollouts."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import orjson
from django.conf import settings
from django.db import IntegrityError, OperationalError, connection
from psycopg.errors import DeadlockDetected, ForeignKeyViolation

from cache import ledger
from cache.models import Snapshot
from cache.notfound import unknown_task
from cache.prepared import prepared_cursor
from cache.tcg import RecordedState, canonical_call, record_plan, result_json
from cache.tcg.records import CallRecord
from cache.tcg.snapshots import snapshot_wanted
from core.errors import Conflict, PayloadTooLarge

from .lookup import ANY_LIVE_SNAPSHOT, SNAPSHOT_WALK, task_chain
from .rollouts import ADD_CALL_SQL, GROW_SQL, KeptAppend, rollout_ended
from .snapshots import EVICTION_NOTICE_S, backend_costs, snapshot_would_stay
from .tasks import task_handle
from .totals import RECORD_TOTALS_SQL

# Insert the node (its parent is the history's last state-changing node, if recorded) and, when
# it is new, count the execution. ON CONFLICT DO NOTHING makes two concurrent records of the
# same path yield one node; the loser reads the winner's row below. The call's claim (lookup.py,
# client-mode single flight) lapses two seconds after it rather than now (a claim that had
# already lapsed too): a rollout whose lookup missed the node just before this commit would
# otherwise take a free claim and execute the call again; it is told to wait instead, and its
# next lookup hits. The node counts in its task's totals in the same statement (totals.py).
#
# The keys come from this process's handle of the task, which may be outdated: nothing is written
# unless the task's stamp (version, created_at) is the handle's, and the statement returns the
# stamp, so that an outdated handle is read again and the statement run again with its keys (as
# lookups do). It also returns the replay cost since the nearest live snapshot on the path, for
# the snapshot decision (the new node has no snapshot yet): up the parent links from the anchor's
# node (`parent`, read once for the insert and the walk), at most SNAPSHOT_WALK of them and none in
# a task without a live snapshot (lookup.py), an index probe each whatever the statistics say, so
# that a record costs the same after 10 calls or 1,000; and the task's live snapshots, counted. One
# round trip instead of three. A state-keyed hit's node (`merged_from`: docs/design/state-match.md)
# is stored the same way; it counts no execution.
_LIVE = "EXISTS (SELECT FROM cache_snapshot s WHERE s.node_id = n.id AND s.status = 'live')"
_STAMP = "task.version = %(version)s AND task.created_at = %(created_at)s"


# The refs of the task's client-owned snapshots evicted lately, which a client-mode record's answer
# tells its client to delete (read in the record's statement: one round trip less per record).
_EVICTED = f"""(SELECT coalesce(json_agg(s.ref), '[]')::text FROM cache_snapshot s
    WHERE s.task_id = %(task)s AND s.status = '{Snapshot.Status.EVICTED.value}' AND s.owner = '{Snapshot.Owner.CLIENT.value}'
      AND s.evicted_at >= now() - %(notice_s)s * interval '1 second')"""


@functools.cache
def record_sql(append: bool = False, also: str = "", evicted: bool = False) -> str:
    """The record's statement. `go` is a row where it writes: the task's stamp is the handle's and,
    with `append`, the rollout's kept history grew by the call (rollouts.py's `grown`, in the same
    statement); `also` is a caller's write (an UPDATE, its WHERE holding `EXISTS (SELECT FROM go)`)
    that commits with it. Nothing is written unless all of it is: the statement is its own
    transaction, one round trip and one commit. With `evicted`, it reads the task's client-owned
    snapshots evicted lately too."""
    grown = f"grown AS ({GROW_SQL.format(guard=f' AND EXISTS (SELECT FROM task WHERE {_STAMP})')}), kept AS ({ADD_CALL_SQL}), "
    return f"""
WITH task AS (
    SELECT version, created_at FROM cache_task WHERE id = %(task)s
), {grown if append else ""}go AS (
    SELECT FROM task WHERE {_STAMP}{" AND EXISTS (SELECT FROM grown)" if append else ""}
), parent AS (
    SELECT id, cum_exec_ms, parent_id FROM cache_node
    WHERE task_id = %(task)s AND mutates AND state_key = decode(%(anchor)s, 'hex')
), ins AS (
    INSERT INTO cache_node (task_id, anchor_key, call_digest, state_key, parent_id, depth, tool, call, mutates,
                            result_json, result_bytes, exec_ms, cum_exec_ms, hit_count, first_rollout_id,
                            first_epoch, pinned, created_at, state_fingerprint, state_shape, state_order, file_times,
                            live_processes, merged_from)
    SELECT %(task)s, decode(%(anchor)s, 'hex'), decode(%(digest)s, 'hex'), decode(%(state_key)s, 'hex'),
           (SELECT id FROM parent), %(depth)s, %(tool)s,
           %(call)s::jsonb, %(mutates)s, %(result)s, %(result_bytes)s, %(exec_ms)s,
           coalesce((SELECT cum_exec_ms FROM parent), 0) + %(own_cost)s, 0, %(rollout)s, %(epoch)s, false, now(),
           %(fingerprint)s, %(shape)s, %(order)s, %(file_times)s::jsonb, %(processes)s, %(merged_from)s::bigint
    FROM go
    ON CONFLICT (task_id, anchor_key, call_digest) DO NOTHING
    RETURNING id, cum_exec_ms, parent_id
), totals AS ({RECORD_TOTALS_SQL}), stat AS (
    INSERT INTO cache_toolstat (task_id, epoch, tool, calls, hits, oracle_hits, executions, executed_ms, saved_ms)
    SELECT %(task)s, %(epoch)s, %(tool)s, 0, 0, 0, 1, %(exec_ms)s, 0 FROM ins WHERE %(merged_from)s::bigint IS NULL
    ON CONFLICT (task_id, epoch, tool) DO UPDATE SET
        executions = cache_toolstat.executions + 1, executed_ms = cache_toolstat.executed_ms + EXCLUDED.executed_ms
), unclaim AS (
    UPDATE cache_claim SET expires_at = clock_timestamp() + interval '2 seconds'
    WHERE task_id = %(task)s AND anchor_key = %(anchor)s AND call_digest = %(digest)s AND EXISTS (SELECT FROM go)
){f", also AS ({also})" if also else ""}
SELECT task.version, task.created_at, ins.id, ins.cum_exec_ms, %(mutates)s, (
    WITH RECURSIVE walk(parent_id, steps, cum_exec_ms, live) AS (
        SELECT n.parent_id, 0, n.cum_exec_ms, {_LIVE} FROM parent n
        UNION ALL
        SELECT n.parent_id, walk.steps + 1, n.cum_exec_ms, {_LIVE}
        FROM walk JOIN cache_node n ON n.id = walk.parent_id
        WHERE NOT walk.live AND walk.steps < %(walk)s AND {ANY_LIVE_SNAPSHOT}
    ) SELECT coalesce(max(cum_exec_ms) FILTER (WHERE live), 0) FROM walk),
    (SELECT coalesce(sum(t.live), 0) FROM cache_snapshottotal t WHERE t.task_id = %(task)s),
    {"EXISTS (SELECT FROM grown)" if append else "true"}, {_EVICTED if evicted else "NULL"}
FROM task LEFT JOIN ins ON true
"""


EXISTING_SQL = """SELECT id, cum_exec_ms, mutates FROM cache_node
WHERE task_id = %s AND anchor_key = decode(%s, 'hex') AND call_digest = decode(%s, 'hex')"""


@dataclass(frozen=True, slots=True)
class MergedNode:
    """What a state-keyed hit's node copies of the executed node it merged with (`node_id`): the
    result's bytes as stored; the state it left comes as the record's RecordedState."""

    node_id: int
    result_json: str


@dataclass(frozen=True, slots=True)
class RecordOutcome:
    node_id: int
    created: bool
    mutates: bool  # the node's: False if the call was recorded as read-only (maybe by another rollout)
    snapshot_wanted: bool
    evicted: list[str]
    key: tuple[str, str]  # (anchor state key, call digest): the node's, and its call's claim's (flight.py)


def _insert_params(
    task, chain, plan, record: CallRecord, state: RecordedState, stored: str, merged: MergedNode | None
) -> dict:
    last, context = chain.steps[-1], record.context
    return {
        "task": task.task_id,
        "version": task.version,
        "created_at": task.created_at,
        "anchor": plan.anchor,
        "digest": plan.digest,
        "state_key": plan.state_key,
        "depth": plan.depth,
        "tool": last.call.tool,
        "call": canonical_call(last.call).decode(),
        "mutates": plan.mutates,
        "result": stored,
        "result_bytes": len(stored),
        "exec_ms": record.exec_ms,
        "own_cost": record.exec_ms if plan.mutates else 0.0,
        "rollout": context.rollout_id,
        "epoch": context.epoch,
        "fingerprint": state.full,
        "shape": state.shape,
        "order": state.order,
        "file_times": json.dumps(dict(state.file_times)) if state.file_times is not None else None,
        "processes": state.processes if plan.mutates else 0,
        "merged_from": merged.node_id if merged else None,
        "walk": SNAPSHOT_WALK,
        "notice_s": EVICTION_NOTICE_S,
    }


def node_record(
    *,
    task_id: str,
    record: CallRecord,
    state: RecordedState = RecordedState(),
    keeps_processes: bool = False,
    evicted: bool = True,
    merged: MergedNode | None = None,
    append: KeptAppend | None = None,
    also: tuple[str, dict] | None = None,
) -> RecordOutcome:
    """`state`: what the node keeps of the sandbox after the call (RecordedState). A snapshot of a
    state with live processes is wanted only where it would keep them (`keeps_processes`).
    `evicted=False`: the caller owns no snapshot (the service's own are never listed), so the
    client-owned snapshots evicted lately are not read. `merged`: a state-keyed hit's node, which
    stores the bytes of the node it merged with, counts no execution and no step of the rollout's
    path (its lookup counts the hit) and wants no snapshot (that node's stands in for it).
    `append`: the call joins its rollout's kept history in the same statement (tool-server mode);
    `also`: a caller's write and its parameters that commit with the node (record_sql). Where the
    history has grown meanwhile or the rollout has ended, nothing is written (409 rollout_finished)."""
    context = record.context
    stored = merged.result_json if merged else result_json(record.result).decode()
    limit = settings.TVCACHE["MAX_RESULT_BYTES"]
    if len(stored) > limit:
        raise PayloadTooLarge(
            f"Result is {len(stored)} bytes; the limit is {limit}.",
            code="result_too_large",
            details={"limit": limit, "size": len(stored)},
        )
    task, row = task_handle(task_id=task_id, cached=True), None
    for fresh in (False, True, True):  # an outdated handle is read again (the task may change meanwhile)
        if fresh:
            task = task_handle(task_id=task_id)
        try:
            task.check_fingerprint(context.env_fingerprint)
        except Conflict:
            if fresh:
                raise
            continue  # the handle may be outdated: the current fingerprint decides
        chain = task_chain(task, context)
        plan = record_plan(chain, task.policy, record.mutated)
        params = _insert_params(task, chain, plan, record, state, stored, merged)
        if append is not None:
            params.update(append.params())
        if also is not None:
            params.update(also[1])
        try:
            with prepared_cursor() as cursor:
                cursor.execute(record_sql(append is not None, also[0] if also else "", evicted), params)
                row = cursor.fetchone()
        except (IntegrityError, OperationalError) as exc:
            # The parent was deleted between the statement's read of it and its key check (retention
            # evicted the path: nodes.py): run again, the parent is not found, and the node is stored
            # with none, under its own key all the same. Or PostgreSQL broke a deadlock by aborting
            # the statement: run again. The statement is its own transaction: it wrote nothing.
            # Inside a caller's transaction the failed statement has aborted it: the caller's
            # transaction fails instead (a live path is never evicted).
            if connection.in_atomic_block or not isinstance(exc.__cause__, (ForeignKeyViolation, DeadlockDetected)):
                raise
            continue
        if row is None:  # the task is gone
            raise unknown_task(task_id)
        if (row[0], row[1]) == task.stamp:
            break
    else:
        raise Conflict("The task kept changing while this call was recorded; record it again.", code="task_changed")
    _, _, node_id, cum_exec_ms, node_mutates, nearest_cum, live_snapshots, appended, evicted_refs = row
    if not appended:
        raise rollout_ended()
    created = node_id is not None
    if not created:
        with connection.cursor() as cursor:
            cursor.execute(EXISTING_SQL, [task.task_id, plan.anchor, plan.digest])
            node_id, cum_exec_ms, node_mutates = cursor.fetchone()
    last = chain.steps[-1]
    if created:
        ledger.node_created(task.task_id, node_id)
    elif record.replay:
        ledger.replay_add(task_id=task.task_id, epoch=context.epoch, tool=last.call.tool, ms=record.exec_ms)
    if not record.replay and merged is None:
        ledger.step_add(
            task_id=task.task_id,
            rollout_id=context.rollout_id,
            epoch=context.epoch,
            applied=len(context.history),
            trace=context.trace,
            node_id=node_id,
        )
    # Only the rollout that created the node is asked for a snapshot: rollouts racing on the
    # same call (or replaying it) would each pay for one, and all but one be thrown away. A task at
    # its budget is asked for none that its eviction would throw away at once (snapshots.py).
    wanted = (
        created
        and merged is None
        and plan.mutates
        and task.sandbox_budget > 0
        and snapshot_wanted(
            mutates=True,
            replay_cost_ms=cum_exec_ms - nearest_cum,
            costs=backend_costs(task.backend),
            live_processes=state.processes,
            keeps_processes=keeps_processes,
        )
        and (
            live_snapshots < task.sandbox_budget
            or snapshot_would_stay(task_id=task.task_id, depth=plan.depth, cum_exec_ms=cum_exec_ms)
        )
    )
    return RecordOutcome(
        node_id=node_id,
        created=created,
        mutates=node_mutates,
        snapshot_wanted=wanted,
        evicted=orjson.loads(evicted_refs) if evicted else [],
        key=(plan.anchor, plan.digest),
    )
