"""The totals of a task's graph (cache.models.TaskTotal), per tool: nodes, top-level nodes, result
bytes, states with live processes, divergent nodes and exec times by bucket. Stats and pages read
them instead of scanning the task's nodes, so they stay flat as a graph grows
(docs/operations/growth.md).

They stay exact because they change in the same transaction as the nodes they count, here and
nowhere else:

- a record adds its node in its own INSERT statement (record.py embeds `RECORD_TOTALS_SQL`);
- whatever deletes nodes calls `task_totals_remove` with them first, in its transaction (subtree
  eviction, result eviction), or `task_totals_clear` before it drops a whole graph (flush, a new
  environment);
- marking a node divergent calls `task_totals_add` with `divergent=1` once its UPDATE matched;
- bulk loads (the growth benchmark) call `task_totals_count` for the id range they wrote.

Lock order: the task's totals rows, then its nodes. A record holds its tool's row until it commits
and only then checks its parent's key, so a removal that locked the nodes first could deadlock
with a record of a child below them.
"""

from __future__ import annotations

from django.db import connection

from cache.tcg.exectimes import BUCKET_SQL, BUCKETS

# Adding a delta row: every column adds up, the histograms element by element.
_ON_CONFLICT = """
ON CONFLICT (task_id, tool) DO UPDATE SET
    nodes = cache_tasktotal.nodes + EXCLUDED.nodes,
    roots = cache_tasktotal.roots + EXCLUDED.roots,
    result_bytes = cache_tasktotal.result_bytes + EXCLUDED.result_bytes,
    process_states = cache_tasktotal.process_states + EXCLUDED.process_states,
    divergent = cache_tasktotal.divergent + EXCLUDED.divergent,
    exec_ms_buckets = (SELECT array_agg(a + b ORDER BY i)
                       FROM unnest(cache_tasktotal.exec_ms_buckets, EXCLUDED.exec_ms_buckets) WITH ORDINALITY
                            AS u(a, b, i))
"""
_COLUMNS = "(task_id, tool, nodes, roots, result_bytes, process_states, divergent, exec_ms_buckets)"

# record.py's INSERT statement counts the node it inserted (its CTE `ins`, RETURNING parent_id) in
# the same statement: exact whatever the concurrency, one round trip as before.
RECORD_TOTALS_SQL = f"""
INSERT INTO cache_tasktotal {_COLUMNS}
SELECT %(task)s, %(tool)s, 1, (ins.parent_id IS NULL)::int, %(result_bytes)s,
       (%(mutates)s AND %(processes)s > 0)::int, 0,
       (SELECT array_agg((b = {BUCKET_SQL.format(ms="%(exec_ms)s::float8")})::int ORDER BY b)
        FROM generate_series(0, {BUCKETS - 1}) AS b)
FROM ins
{_ON_CONFLICT}
"""

# The sums of a set of node rows `rows`, per task and tool, times `sign`, added to the totals.
_SUMS_SQL = f"""
per AS (
    SELECT task_id, tool, count(*) AS nodes, count(*) FILTER (WHERE parent_id IS NULL) AS roots,
           coalesce(sum(result_bytes), 0) AS result_bytes,
           count(*) FILTER (WHERE mutates AND live_processes > 0) AS process_states,
           count(*) FILTER (WHERE divergent) AS divergent
    FROM rows GROUP BY task_id, tool
), hist AS (
    SELECT task_id, tool, {BUCKET_SQL.format(ms="exec_ms")} AS b, count(*) AS n FROM rows GROUP BY 1, 2, 3
)
INSERT INTO cache_tasktotal {_COLUMNS}
SELECT p.task_id, p.tool, %(sign)s * p.nodes, %(sign)s * p.roots, %(sign)s * p.result_bytes,
       %(sign)s * p.process_states, %(sign)s * p.divergent,
       (SELECT array_agg(%(sign)s * coalesce(h.n, 0)::int ORDER BY s.b)
        FROM generate_series(0, {BUCKETS - 1}) AS s(b)
        LEFT JOIN hist h ON h.task_id = p.task_id AND h.tool = p.tool AND h.b = s.b)
FROM per p
ORDER BY p.tool
{_ON_CONFLICT}
"""

_NODE_COLUMNS = "id, task_id, tool, parent_id, result_bytes, mutates, live_processes, divergent, exec_ms"

LOCK_TOTALS_SQL = "SELECT 1 FROM cache_tasktotal WHERE task_id = %s ORDER BY tool FOR UPDATE"

REMOVE_SQL = f"""
WITH rows AS MATERIALIZED (
    SELECT {_NODE_COLUMNS} FROM cache_node
    WHERE task_id = %(task)s AND id = ANY(%(ids)s) ORDER BY id FOR UPDATE
), {_SUMS_SQL}
RETURNING (SELECT array_agg(id) FROM rows)
"""

COUNT_SQL = f"""
WITH rows AS MATERIALIZED (
    SELECT {_NODE_COLUMNS} FROM cache_node WHERE id BETWEEN %(first)s AND %(last)s
), {_SUMS_SQL}
"""

ADD_SQL = f"""
INSERT INTO cache_tasktotal {_COLUMNS}
VALUES (%(task)s, %(tool)s, 0, 0, 0, 0, %(divergent)s, array_fill(0, ARRAY[{BUCKETS}]))
{_ON_CONFLICT}
"""


def task_totals_lock(*, task_id: str) -> None:
    """Lock the task's totals rows, in the caller's transaction, before it locks any of the task's
    nodes to delete them: a record holds its totals row and then checks its parent's key, so
    locking nodes first could deadlock with it."""
    with connection.cursor() as cursor:
        cursor.execute(LOCK_TOTALS_SQL, [task_id])


def task_totals_remove(*, task_id: str, node_ids: list[int]) -> list[int]:
    """Take the task's nodes of `node_ids` off its totals, before they are deleted in the caller's
    transaction: locks the task's totals rows, then those nodes (a record cannot add a child
    below a locked node until the caller ends). Returns the ids it found and locked: delete those.
    Deleting a node deletes its children too (its foreign key cascades): pass whole subtrees, or
    nodes whose children go as well."""
    if not node_ids:
        return []
    with connection.cursor() as cursor:
        cursor.execute(LOCK_TOTALS_SQL, [task_id])
        cursor.execute(REMOVE_SQL, {"task": task_id, "ids": list(node_ids), "sign": -1})
        rows = cursor.fetchall()
    return sorted(rows[0][0]) if rows and rows[0][0] else []


def task_totals_clear(*, task_id: str) -> None:
    """The task's graph is about to be dropped whole (in the caller's transaction): its totals go
    first, so a record that lands meanwhile waits and then counts its node afresh."""
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM cache_tasktotal WHERE task_id = %s", [task_id])


def task_totals_add(*, task_id: str, tool: str, divergent: int) -> None:
    """Count nodes of the tool in or out of the task's divergent ones (a mark the caller's UPDATE
    made, in its transaction)."""
    with connection.cursor() as cursor:
        cursor.execute(ADD_SQL, {"task": task_id, "tool": tool, "divergent": divergent})


def task_totals_count(*, first_id: int, last_id: int) -> None:
    """Add the nodes with ids in [first_id, last_id] to their tasks' totals: rows a bulk load wrote
    without the service (the growth benchmark's COPY)."""
    with connection.cursor() as cursor:
        cursor.execute(COUNT_SQL, {"first": first_id, "last": last_id, "sign": 1})
