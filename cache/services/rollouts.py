"""Rollouts whose history the service keeps (tool-server mode, the verl-tool proxy): the history
holds the calls that changed the rollout's state; one call of a rollout runs at a time."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import orjson
from django.db import connection
from django.db.models import Expression
from django.db.models.expressions import RawSQL
from django.utils import timezone

from cache.models import Rollout, RolloutCall
from cache.notfound import unknown_task
from cache.prepared import prepared_cursor
from cache.tcg import ToolCall, call_digest
from core.errors import Conflict
from core.ttl import RecentMemo

log = logging.getLogger("tvcache.rollouts")

# The histories this process read lately, by (task, rollout id): (the rollout's row, its calls).
# A process serves a few hundred rollouts at a time; those of ended ones age out.
_histories: RecentMemo[tuple[str, str], tuple[tuple[int, Any], tuple[ToolCall, ...]]] = RecentMemo(2048)

# The rollout and a session advisory lock on it (pg_try_advisory_lock is evaluated for the one row),
# and its history: only the calls from position `n` on where this process read those before them
# of the same rollout row (`suffix`; a row is named by its id and its start, so that even a row
# made again under a reused id after a restore is read whole). A history only grows (APPEND_SQL),
# so what was read of it is its prefix for good, and a rollout's next call reads what was appended
# since, not its whole history.
CLAIM_SQL = """
SELECT r.id, r.started_at, pg_try_advisory_lock(r.id), k.suffix,
       (SELECT coalesce(json_agg(c.call ORDER BY c.position), '[]')::text FROM cache_rolloutcall c
        WHERE c.rollout_id = r.id AND c.position >= CASE WHEN k.suffix THEN p.n ELSE 0 END),
       r.finished_at IS NOT NULL, r.detached_at IS NOT NULL, NULL
FROM (SELECT %s::bigint AS pk, %s::timestamptz AS started_at, %s::int AS n) p
JOIN cache_rollout r ON r.task_id = %s AND r.rollout_id = %s
CROSS JOIN LATERAL (SELECT r.id = p.pk AND r.started_at = p.started_at AND r.history_length >= p.n AS suffix) k
"""

CREATE_SQL = """
INSERT INTO cache_rollout (task_id, rollout_id, epoch, calls, hits, history_length, started_at)
SELECT id, %s, %s, 0, 0, 0, now() FROM cache_task WHERE id = %s
ON CONFLICT (task_id, rollout_id) DO NOTHING
"""

# One row more, whatever the history's length; none if the history has grown meanwhile or the
# rollout has ended. Two parts, so that a tool-server miss's record appends in its own statement
# (record.py): `grown` grows the length (`{guard}`: the record's condition), then the call's row.
GROW_SQL = """
    UPDATE cache_rollout SET history_length = history_length + 1
    WHERE id = %(kept_rollout)s AND history_length = %(kept_length)s AND finished_at IS NULL{guard}
    RETURNING id, history_length - 1 AS position"""
ADD_CALL_SQL = """
    INSERT INTO cache_rolloutcall (rollout_id, position, call) SELECT id, position, %(kept_call)s::jsonb FROM grown"""
APPEND_SQL = f"WITH grown AS ({GROW_SQL.format(guard='')}){ADD_CALL_SQL}"


@dataclass(frozen=True, slots=True)
class KeptAppend:
    """The call appended to a rollout's kept history of `length` calls (APPEND_SQL's parameters)."""

    rollout_pk: int
    length: int
    call: ToolCall

    def params(self) -> dict[str, Any]:
        return {
            "kept_rollout": self.rollout_pk,
            "kept_length": self.length,
            "kept_call": orjson.dumps(self.call.to_json()).decode(),
        }


@dataclass(frozen=True, slots=True)
class RolloutClaim:
    rollout: Rollout
    history: tuple[ToolCall, ...]
    # Known-state rule: the rollout left the shared graph (docs/design/guarantees.md).
    detached: bool
    extra: Any  # the caller's expression's value
    row_key: bytes = b""  # names the rollout's row for good (its id and its start): kept_digests


def rollout_claim(*, task_id: str, rollout_id: str, epoch: int = 0, extra: Expression | None = None) -> RolloutClaim:
    """The rollout (created on its first call) with its history, claimed by this call until
    `rollout_unclaim`: one call of a rollout at a time, since a second one would run in the same
    state and leave it ahead of the history. It is refused (409), never queued: the client broke
    the order. `extra` is an expression over the rollout (an Exists of a caller's rows), read in
    the same statement."""
    sql, params = (CLAIM_SQL, []) if extra is None else _claim_sql(extra)
    (known_pk, known_start), known = _histories.get((task_id, rollout_id)) or ((0, None), ())
    params = [*params, known_pk, known_start, len(known), task_id, rollout_id]
    with prepared_cursor() as cursor:  # (planned once per connection: every call of every rollout)
        cursor.execute(sql, params)
        row = cursor.fetchone()
        if row is None:
            cursor.execute(CREATE_SQL, [rollout_id, epoch, task_id])
            cursor.execute(sql, params)
            row = cursor.fetchone()
    if row is None:  # the task was deleted
        raise unknown_task(task_id)
    pk, started_at, claimed, suffix, read, finished, detached, extra = row
    if not claimed:
        raise Conflict(
            "Another call of this rollout is running; a rollout's calls come one after the other.", code="rollout_busy"
        )
    if finished:
        rollout_unclaim(rollout_pk=pk)
        raise Conflict(f"Rollout '{rollout_id}' has ended.", code="rollout_finished")
    rollout = Rollout(pk=pk, task_id=task_id, rollout_id=rollout_id, epoch=epoch)
    calls = tuple(ToolCall.from_json(item) for item in orjson.loads(read))
    history = known + calls if suffix else calls
    _histories.put((task_id, rollout_id), ((pk, started_at), history))
    row_key = hashlib.sha256(b"%d\0%s" % (pk, started_at.isoformat().encode())).digest()
    return RolloutClaim(rollout, history, detached, extra, row_key)


def kept_digests(row_key: bytes, history: tuple[ToolCall, ...], call: ToolCall) -> tuple[bytes, bytes]:
    """The memo keys of a kept history (CallContext.history_digest, next_digest) in O(1), where
    client mode's digest the history's JSON (inputs.py): a rollout's history only grows, so its
    first n - 1 calls are the same for good, and the rollout's row, the length n and the last call
    name the whole of it; the history after `call` is named by n + 1 and `call`, whether or not
    `call` joins it (a key names a sequence of calls, never a state that may be another)."""

    def named(length: int, last: ToolCall | None) -> bytes:
        tail = call_digest(last).encode() if last is not None else b""
        return hashlib.sha256(b"kept\0%s\0%d\0%s" % (row_key, length, tail)).digest()

    return named(len(history), history[-1] if history else None), named(len(history) + 1, call)


_compiled: dict[int, tuple[Expression, str, tuple]] = {}


def _claim_sql(extra: Expression) -> tuple[str, tuple]:
    """CLAIM_SQL with `extra` as its last column, compiled by the ORM once per expression, and
    the parameters that column takes (they come before the claim's own)."""
    compiled = _compiled.get(id(extra))
    if compiled is None or compiled[0] is not extra:
        # A subquery on the claimed row `r`: the expression as Django compiles it for a rollout.
        query = Rollout.objects.filter(pk=RawSQL("r.id", ())).annotate(extra=extra).values("extra").query
        sql, params = query.sql_with_params()
        compiled = _compiled[id(extra)] = (extra, CLAIM_SQL.replace(", NULL\n", f", ({sql})\n"), params)
    return compiled[1], compiled[2]


def rollout_unclaim(*, rollout_pk: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_unlock(%s)", [rollout_pk])


def rollout_history_append(*, rollout_pk: int, call: ToolCall, length: int) -> None:
    """Append a state-changing call to a history that has `length` calls."""
    with connection.cursor() as cursor:
        cursor.execute(APPEND_SQL, KeptAppend(rollout_pk, length, call).params())
        if cursor.rowcount != 1:
            raise rollout_ended()


def rollout_ended() -> Conflict:
    return Conflict("The rollout ended while its call ran.", code="rollout_finished")


def kept_history(rollout_pk: int, length: int) -> tuple[ToolCall, ...]:
    """The first `length` calls of a rollout's kept history."""
    calls = RolloutCall.objects.filter(rollout_id=rollout_pk, position__lt=length).order_by("position")
    return tuple(ToolCall.from_json(item) for item in calls.values_list("call", flat=True))


def kept_histories_add(rollouts: list[Rollout], history: tuple[ToolCall, ...]) -> None:
    """The same history for each of `rollouts` (branches made at one point): its calls' rows."""
    RolloutCall.objects.bulk_create(
        RolloutCall(rollout=rollout, position=position, call=call.to_json())
        for rollout in rollouts
        for position, call in enumerate(history)
    )


def rollout_detach(*, rollout: Rollout, reason: str) -> None:
    """Take the rollout off the shared graph (known-state rule): its later calls are served
    uncached and unrecorded, so nothing it sees is filed under a state key it may not have reached."""
    log.info("rollout %s of task %s detached: %s", rollout.rollout_id, rollout.task_id, reason)
    Rollout.objects.filter(pk=rollout.pk).update(detached_at=timezone.now(), detached_reason=reason[:2000])
