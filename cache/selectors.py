"""Reads of the tool call graphs: task stats and graph export."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from django.db import connection
from django.db.models import BooleanField, Count, Max, OuterRef, Q, QuerySet, Subquery, Sum
from django.db.models.expressions import RawSQL

from accounts.models import Project
from cache.ledger import ledger_flush
from cache.models import (
    Divergence,
    MaterializationStat,
    Node,
    RolloutTotal,
    Snapshot,
    SnapshotTotal,
    Task,
    TaskTotal,
    ToolStat,
)
from cache.notfound import unknown_node, unknown_task
from cache.prepared import prepared_cursor
from cache.tcg.exectimes import histogram_median
from core.errors import InvalidInput
from core.inputs import INT32, INT64

COUNTERS = ("calls", "hits", "oracle_hits", "state_hits", "state_oracle_hits", "executions", "executed_ms", "saved_ms")
DIVERGENT_NODES_LISTED = 100


def task_get(*, task_id: str) -> Task:
    task = Task.objects.filter(pk=task_id).first()
    if task is None:
        raise unknown_task(task_id)
    return task


def node_check(*, task_id: str, node_id: int) -> None:
    """NotFound unless the task has the node (a route's target, checked before its role)."""
    if not Node.objects.filter(task_id=task_id, pk=node_id).exists():
        raise unknown_node(task_id, node_id)


def _rates(row: dict[str, Any]) -> dict[str, Any]:
    calls = row.get("calls") or 0
    out = {key: row.get(key) or 0 for key in COUNTERS}
    out["hit_rate"] = out["hits"] / calls if calls else 0.0
    out["oracle_hit_rate"] = out["oracle_hits"] / calls if calls else 0.0
    out["state_oracle_hit_rate"] = out["state_oracle_hits"] / calls if calls else 0.0
    return out


def task_stats(*, task_id: str) -> dict[str, Any]:
    """Totals, per epoch and per tool; plus graph sizes."""
    ledger_flush()
    rows = ToolStat.objects.filter(task_id=task_id)
    sums = {key: Sum(key) for key in COUNTERS}
    total = _rates(rows.aggregate(**sums))
    per_epoch = [dict(epoch=r["epoch"], **_rates(r)) for r in rows.values("epoch").annotate(**sums).order_by("epoch")]
    per_tool = [dict(tool=r["tool"], **_rates(r)) for r in rows.values("tool").annotate(**sums).order_by("tool")]
    graph = TaskTotal.objects.filter(task_id=task_id).aggregate(nodes=Sum("nodes"), results_bytes=Sum("result_bytes"))
    snapshots = snapshot_totals(SnapshotTotal.objects.filter(task_id=task_id))
    keeping_processes = snapshots.pop("live_processes")
    return {
        **total,
        "nodes": graph["nodes"] or 0,
        "results_bytes": graph["results_bytes"] or 0,
        "snapshots": {key: value or 0 for key, value in snapshots.items()},
        "rollouts": sum(_rollout_total(task_id)),
        "per_epoch": per_epoch,
        "per_tool": per_tool,
        "divergences": task_divergences(task_id=task_id),
        "processes": task_processes(task_id=task_id, snapshots=keeping_processes),
    }


def _rollout_total(task_id: str) -> tuple[int, int]:
    """The task's rollouts counted (cache.models.RolloutTotal): those kept, those expired."""
    return RolloutTotal.objects.filter(task_id=task_id).values_list("rollouts", "expired").first() or (0, 0)


def task_rollouts_kept(*, task_id: str) -> int:
    """How many rollout rows the task keeps, read from its counter rather than counted (a task of a
    long run has hundreds of thousands)."""
    return _rollout_total(task_id)[0]


def snapshot_totals(totals: QuerySet) -> dict[str, int]:
    """The snapshot counters (cache.models.SnapshotTotal) of the given rows added up: live, their
    bytes, those keeping processes, evicted. A row per task and backend, not one per snapshot."""
    sums = totals.aggregate(
        live=Sum("live"), live_bytes=Sum("live_bytes"), live_processes=Sum("live_processes"), evicted=Sum("evicted")
    )
    return {key: value or 0 for key, value in sums.items()}


def task_totals(*, task_id: str) -> dict[str, dict[str, Any]]:
    """The task's graph totals per tool (cache.models.TaskTotal): nodes, top-level nodes, result
    bytes, states with processes, divergent nodes and the median exec time (from its histogram,
    within a bucket's width); tools with no node left out."""
    rows = TaskTotal.objects.filter(task_id=task_id, nodes__gt=0).order_by("tool")
    return {
        row.tool: {
            "nodes": row.nodes,
            "roots": row.roots,
            "result_bytes": row.result_bytes,
            "process_states": row.process_states,
            "divergent": row.divergent,
            "median_exec_ms": histogram_median(row.exec_ms_buckets),
        }
        for row in rows
    }


def task_processes(*, task_id: str, snapshots: int) -> dict[str, Any]:
    """States with live processes (a server, a daemon an agent left running) and how tool-server
    misses got their sandboxes to the states of their histories, with and without live processes
    (MaterializationStat, written by the ledger: task_stats flushes it first). `snapshots`: the
    task's live snapshots that keep processes, as task_stats read them from the counters."""
    counts = {
        (row["how"], row["processes"]): row["count"]
        for row in MaterializationStat.objects.filter(task_id=task_id).values("how", "processes", "count")
    }
    materialized = [
        {
            "how": how,
            "label": label,
            "with_processes": counts.get((how, True), 0),
            "without": counts.get((how, False), 0),
        }
        for how, label in MaterializationStat.How.choices
        if (how, True) in counts or (how, False) in counts
    ]
    # From the task's divergences (few), not its nodes (millions in a large graph).
    drifted = Divergence.objects.filter(task_id=task_id, kind=Divergence.Kind.DRIFT, node__mutates=True)
    return {
        "states": TaskTotal.objects.filter(task_id=task_id).aggregate(n=Sum("process_states"))["n"] or 0,
        "snapshots": snapshots,
        "drifted": drifted.values("node_id").distinct().count(),
        "materialized": materialized,
    }


def task_divergences(*, task_id: str) -> dict[str, Any]:
    """What the determinism audit and state verification found: divergences in all, per tool
    (with its divergent nodes and whether the audit made it uncacheable) and per node (the
    most recent first)."""
    uncacheable = Task.objects.filter(pk=task_id).values_list("uncacheable_tools", flat=True).first() or []
    rows = Divergence.objects.filter(task_id=task_id)
    counts = {
        r["tool"]: r
        for r in rows.values("tool").annotate(
            count=Count("id"),
            audit=Count("id", filter=Q(kind=Divergence.Kind.AUDIT)),
            state=Count("id", filter=Q(kind=Divergence.Kind.STATE)),
        )
    }
    divergent = dict(TaskTotal.objects.filter(task_id=task_id, divergent__gt=0).values_list("tool", "divergent"))
    per_tool = [
        {
            "tool": tool,
            "count": counts.get(tool, {}).get("count", 0),
            "audit": counts.get(tool, {}).get("audit", 0),
            "state": counts.get(tool, {}).get("state", 0),
            "divergent_nodes": divergent.get(tool, 0),
            "uncacheable": tool in uncacheable,
        }
        for tool in sorted({*counts, *divergent, *uncacheable})
    ]
    per_node = [
        {
            "node_id": r["node_id"],
            "tool": r["node__tool"],
            "call": r["node__call"],
            "divergent": r["node__divergent"],
            "count": r["count"],
            "audit": r["audit"],
            "state": r["state"],
            "last_at": r["last_at"],
        }
        for r in rows.filter(node__isnull=False)
        .values("node_id", "node__tool", "node__call", "node__divergent")
        .annotate(
            count=Count("id"),
            audit=Count("id", filter=Q(kind=Divergence.Kind.AUDIT)),
            state=Count("id", filter=Q(kind=Divergence.Kind.STATE)),
            last_at=Max("created_at"),
        )
        .order_by("-last_at", "-node_id")[:DIVERGENT_NODES_LISTED]
    ]
    return {
        "count": sum(r["count"] for r in per_tool),
        "divergent_nodes": sum(divergent.values()),
        "uncacheable_tools": list(uncacheable),
        "per_tool": per_tool,
        "per_node": per_node,
    }


def project_snapshot_bytes(*, project_id: int) -> int:
    """Bytes of the project's live snapshots (their sizes as registered)."""
    return snapshot_totals(SnapshotTotal.objects.filter(task__project_id=project_id))["live_bytes"]


def task_ids(*, project_id: int | None = None, project_ids: list[int] | None = None, search: str = ""):
    """The keys of the tasks whose id contains `search` (any case), of one project or of several
    (None for both: every project), in order (project, then id): what the task list and the
    dashboard page through."""
    tasks = Task.objects.all()
    if project_id is not None:
        tasks = tasks.filter(project_id=project_id)
    if project_ids is not None:
        tasks = tasks.filter(project_id__in=project_ids)
    if search:
        tasks = tasks.filter(name__icontains=search)
    return tasks.order_by("project__name", "name").values_list("pk", flat=True)


def task_list_stats(*, task_ids: list[str]) -> list[dict[str, Any]]:
    """One row per given task with its totals (a page of the task list or the dashboard overview)."""
    ledger_flush()
    sums = {key: Sum(key) for key in COUNTERS}
    totals = {
        r["task_id"]: _rates(r)
        for r in ToolStat.objects.filter(task_id__in=task_ids).values("task_id").annotate(**sums)
    }
    nodes = dict(
        TaskTotal.objects.filter(task_id__in=task_ids)
        .values("task_id")
        .annotate(n=Sum("nodes"))
        .values_list("task_id", "n")
    )
    live = dict(
        SnapshotTotal.objects.filter(task_id__in=task_ids)
        .values("task_id")
        .annotate(n=Sum("live"))
        .values_list("task_id", "n")
    )
    return [
        {
            "task": task,
            "stats": totals.get(task.pk, _rates({})),
            "nodes": nodes.get(task.pk, 0),
            "live_snapshots": live.get(task.pk, 0),
        }
        for task in Task.objects.filter(pk__in=task_ids).select_related("project").order_by("project__name", "name")
    ]


def node_rows(*, nodes: QuerySet, limit: int, fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """The first `limit` of `nodes` (by depth, then id) as `fields`, each with whether it has a
    live snapshot (`snapshot`): a probe of `snapshot_one_live_per_node` per node, not a read of
    every live snapshot of the task whatever is read. A scalar subquery, not EXISTS: PostgreSQL may
    plan an EXISTS as a hash of every live snapshot (113 ms for the first 150 nodes of a task with
    72,000 snapshots), never a LIMIT 1 subquery."""
    live = Subquery(Snapshot.objects.filter(node_id=OuterRef("pk"), status=Snapshot.Status.LIVE).values("pk")[:1])
    rows = nodes.order_by("depth", "pk").annotate(live_snapshot=live).values(*fields, "live_snapshot")[:limit]
    out = list(rows)
    for row in out:
        row["snapshot"] = row.pop("live_snapshot") is not None
    return out


# Nodes per page of a graph export, at most and by default.
GRAPH_PAGE = 100_000


def graph_export(
    *,
    task_id: str,
    root: int | None = None,
    max_depth: int | None = None,
    limit: int = GRAPH_PAGE,
    after: tuple[int, int] | None = None,
) -> dict:
    """A page of a task's graph: its nodes in order of (depth, id), at most `limit`, those after
    the (depth, id) `after`, and the edges to them; optionally only the subtree under `root`,
    `max_depth` deep. `next` is the cursor of the next page (`graph_cursor`), None on the last:
    a page is an index range, however large the graph (docs/operations/growth.md)."""
    task_get(task_id=task_id)
    ledger_flush()
    nodes = Node.objects.filter(task_id=task_id)
    if root is not None:
        if not Node.objects.filter(task_id=task_id, pk=root).exists():
            raise unknown_node(task_id, root)
        nodes = nodes.filter(pk__in=node_subtree_ids(task_id=task_id, node_id=root, max_depth=max_depth))
    elif max_depth is not None:
        nodes = nodes.filter(depth__lte=max_depth)
    if after is not None:
        # A row comparison: the (task, depth, id) index seeks to it.
        nodes = nodes.filter(RawSQL('("cache_node"."depth", "cache_node"."id") > (%s, %s)', after, BooleanField()))
    out_nodes = node_rows(
        nodes=nodes,
        limit=limit + 1,
        fields=(
            "id",
            "parent_id",
            "depth",
            "tool",
            "call",
            "mutates",
            "exec_ms",
            "hit_count",
            "pinned",
            "divergent",
            "result_bytes",
            "first_rollout_id",
            "first_epoch",
            "merged_from",
        ),
    )
    more = len(out_nodes) > limit
    del out_nodes[limit:]
    edges = [{"source": n["parent_id"], "target": n["id"]} for n in out_nodes if n["parent_id"] is not None]
    last = out_nodes[-1] if more else None
    return {
        "task_id": task_id,
        "nodes": out_nodes,
        "edges": edges,
        "next": None if last is None else f"{last['depth']}.{last['id']}",
    }


def graph_cursor(value: str | None) -> tuple[int, int] | None:
    """The (depth, id) a graph page's `next` names ("depth.id"); InvalidInput if it names none."""
    if value is None:
        return None
    depth, dot, node = value.partition(".")
    if not (dot and depth.isdigit() and node.isdigit() and int(depth) <= INT32[1] and int(node) <= INT64[1]):
        raise InvalidInput(
            "'after' must be the 'next' of a graph page (depth.id).", code="invalid_payload", details={"field": "after"}
        )
    return int(depth), int(node)


SUBTREE_SQL = """
WITH RECURSIVE sub(id, level) AS (
    SELECT id, 0 FROM cache_node WHERE task_id = %s AND id = %s
    UNION ALL
    SELECT n.id, sub.level + 1 FROM cache_node n JOIN sub ON n.parent_id = sub.id
    WHERE %s::int IS NULL OR sub.level < %s::int
) SELECT id FROM sub
"""


def node_subtree_ids(*, task_id: str, node_id: int, max_depth: int | None = None) -> list[int]:
    """Ids of the node and its descendants, `max_depth` levels below it at most (None: all);
    empty for a node the task does not have."""
    with connection.cursor() as cursor:
        cursor.execute(SUBTREE_SQL, [task_id, node_id, max_depth, max_depth])
        return [row[0] for row in cursor.fetchall()]


def _columns(model, names: tuple[str, ...] | None = None) -> list:
    return [f for f in model._meta.concrete_fields if names is None or f.attname in names]


_MISS_TASK_FIELDS = _columns(Task, ("id", "project_id", "env", "tools"))
_MISS_PROJECT_FIELDS = _columns(Project)
_MISS_TASK_SQL = (
    f"SELECT {', '.join(f't.{f.column}' for f in _MISS_TASK_FIELDS)}, "
    f"{', '.join(f'p.{f.column}' for f in _MISS_PROJECT_FIELDS)}{{rider}} "
    f"FROM {Task._meta.db_table} t JOIN {Project._meta.db_table} p ON p.id = t.project_id{{join}} WHERE t.id = %s"
)


@dataclass(frozen=True, slots=True)
class Rider:
    """A caller's write that runs in the task's read, in its round trip: `sql` an UPDATE of one
    row at most of `model`'s table (without RETURNING), `params` its parameters. What it wrote
    comes back as a `model`."""

    model: Any
    sql: str
    params: tuple = ()


@functools.cache
def _miss_task_sql(model=None, sql: str = "") -> str:
    """The task's read, with a rider's write and its row (`model`, `sql`) or alone."""
    if model is None:
        return _MISS_TASK_SQL.format(rider="", join="")
    columns = ", ".join(f.column for f in _columns(model))
    return f"WITH rider AS ({sql} RETURNING {columns}) " + _MISS_TASK_SQL.format(
        rider=", r.*", join=" LEFT JOIN rider r ON true"
    )


def task_for_miss(*, task_id: str, rider: Rider | None = None) -> tuple[Task | None, Any]:
    """The task as a miss reads it (its id, env and tools) with its project whole (the grants), in
    one prepared statement: the ORM compiles a select_related query and PostgreSQL plans it on every
    call (1.4 ms a miss, against 0.2 ms here). Its other fields are deferred (reading one reads it).
    With a `rider`, its write runs in the same statement (whether or not the task is found): the
    row it wrote, or None."""
    with prepared_cursor() as cursor:
        if rider is None:
            cursor.execute(_miss_task_sql(), [task_id])
        else:
            cursor.execute(_miss_task_sql(rider.model, rider.sql), [*rider.params, task_id])
        row = cursor.fetchone()
    if row is None:
        return None, None
    split, end = len(_MISS_TASK_FIELDS), len(_MISS_TASK_FIELDS) + len(_MISS_PROJECT_FIELDS)
    task = Task.from_db(
        connection.alias, [f.attname for f in _MISS_TASK_FIELDS], _loaded(_MISS_TASK_FIELDS, row[:split])
    )
    task.project = Project.from_db(
        connection.alias, [f.attname for f in _MISS_PROJECT_FIELDS], _loaded(_MISS_PROJECT_FIELDS, row[split:end])
    )
    written = None
    if rider is not None and row[end] is not None:  # (its primary key: NULL where it wrote nothing)
        fields = _columns(rider.model)
        written = rider.model.from_db(connection.alias, [f.attname for f in fields], _loaded(fields, row[end:]))
    return task, written


def _loaded(fields, values) -> list:
    """Column values as the model's fields hold them (Django's converters)."""
    return [f.from_db_value(v, None, connection) if hasattr(f, "from_db_value") else v for f, v in zip(fields, values)]
