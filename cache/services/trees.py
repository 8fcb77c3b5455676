"""The rollout tree export (GET /api/v1/tasks/{id}/tree): each rollout's path through the task's
graph, where it branched from, and what the trainer said of it, so that a trainer can pack the
trajectories that share a prefix into one tree (tvclient.trees; docs/design/tree-search.md).

The answer is NDJSON, streamed: a `task` line, one `rollout` line per rollout with its calls, an
`end` line with the cursor of the next page. A page holds at most `limit` rollouts, read
CHUNK_ROLLOUTS at a time, so its memory does not grow with the task. Paths are the rollouts' steps
(cache.models.RolloutStep), which the ledger writes in batches: a call shows up within
TVCACHE_COUNTER_FLUSH_S of its answer."""

from __future__ import annotations

from collections.abc import Iterator

import orjson
from django.db import connection

from accounts.projects import task_public_id
from cache import ledger

DEFAULT_LIMIT = 1000
MAX_LIMIT = 10_000
CHUNK_ROLLOUTS = 200

ROLLOUTS_SQL = """
SELECT id, rollout_id, epoch, trajectory_ref, branch_of, branch_step, branch_node, branch_tokens::text,
       finished_at IS NOT NULL, detached_at IS NOT NULL
FROM cache_rollout
WHERE task_id = %(task)s AND (%(epoch)s::int IS NULL OR epoch = %(epoch)s) AND id > %(after)s
ORDER BY id LIMIT %(limit)s
"""

# Each rollout's calls in order, as one JSON array made by PostgreSQL (beside the worker, on
# another core): the state-changing calls before each, then the trainer's position, then when the
# service answered. A node evicted since leaves its call without tool, digest or time.
CALLS_SQL = """
SELECT rollout_id, jsonb_agg(jsonb_build_object(
    'step', step, 'node_id', node_id, 'parent_id', parent_id, 'tool', tool, 'mutates', mutates, 'cached', hit,
    'result_sha256', digest, 'exec_ms', exec_ms, 'at', at, 'tokens', tokens) ORDER BY step)::text
FROM (
    SELECT s.rollout_id, row_number() OVER w - 1 AS step, s.node_id, n.parent_id, n.tool, n.mutates, s.hit,
           encode(sha256(convert_to(n.result_json, 'UTF8')), 'hex') AS digest, n.exec_ms, s.tokens,
           to_char(to_timestamp(s.at / 1e9) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') AS at
    FROM cache_rolloutstep s LEFT JOIN cache_node n ON n.id = s.node_id
    WHERE s.rollout_id = ANY(%s)
    WINDOW w AS (PARTITION BY s.rollout_id ORDER BY s.applied, s.seq NULLS LAST, s.at, s.id)
) steps
GROUP BY rollout_id
"""


def tree_export(*, task_id: str, epoch: int | None, after: int, limit: int) -> Iterator[bytes]:
    """The page of rollouts after the cursor `after` (0: the first page), in blocks of lines (one
    per CHUNK_ROLLOUTS rollouts). This process's steps are written first, as a stats read does."""
    ledger.ledger_flush()
    yield _line({"kind": "task", "task_id": task_public_id(task_id), "epoch": epoch})
    sent, last, more = 0, after, True
    while more and sent < limit:
        want = min(CHUNK_ROLLOUTS, limit - sent)
        rows = _rollouts(task_id, epoch, last, want)
        if rows:
            calls = _calls([row[0] for row in rows])
            yield b"".join(_rollout(row, calls.get(row[0], "[]")) for row in rows)
            sent, last = sent + len(rows), rows[-1][0]
        more = len(rows) == want
    more = more and bool(_rollouts(task_id, epoch, last, 1))
    yield _line({"kind": "end", "rollouts": sent, "next": str(last) if more else None})


def _rollouts(task_id: str, epoch: int | None, after: int, limit: int) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(ROLLOUTS_SQL, {"task": task_id, "epoch": epoch, "after": after, "limit": limit})
        return cursor.fetchall()


def _calls(rollout_pks: list[int]) -> dict[int, str]:
    with connection.cursor() as cursor:
        cursor.execute(CALLS_SQL, [rollout_pks])
        return dict(cursor.fetchall())


def _rollout(row: tuple, calls: str) -> bytes:
    _, rollout_id, epoch, ref, branch_of, branch_step, branch_node, branch_tokens, finished, detached = row
    branch = None
    if branch_of or branch_node is not None:
        branch = {
            "rollout": branch_of or None,
            "step": branch_step,
            "node_id": branch_node,
            "tokens": None if branch_tokens is None else orjson.loads(branch_tokens),
        }
    head = {
        "kind": "rollout",
        "rollout_id": rollout_id,
        "epoch": epoch,
        "trajectory_ref": ref or None,
        "branch": branch,
        "finished": finished,
        "detached": detached,
    }
    return b"".join((orjson.dumps(head)[:-1], b',"calls":', calls.encode(), b"}\n"))


def _line(item: dict) -> bytes:
    return orjson.dumps(item) + b"\n"
