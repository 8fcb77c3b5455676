"""Reads behind the dashboard pages; the figures come from `cache.selectors`, shaped here for display."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from django.conf import settings
from django.core.paginator import Paginator
from django.db import connection
from django.db.models import Count, F, Q, Sum
from django.utils import timezone
from django.utils.functional import cached_property

from accounts.models import Project
from accounts.selectors import project_request_rate, project_tokens
from cache import selectors as cache_selectors
from cache.models import Lease, Node, Rollout, Snapshot, ToolStat
from cache.notfound import unknown_node
from core.errors import NotFound
from sandboxes.handles import service_images
from sandboxes.selectors import (
    engines_seen,
    fork_latency,
    live_sandboxes_per_task,
    pool_task_keys,
    pool_tasks,
    pool_totals,
    snapshot_usage,
    task_live_snapshots,
)
from sandboxes.selectors import live_sandboxes as live_sandbox_count

GRAPH_LEVELS = 3  # levels fetched at first paint and per expansion
# Nodes per fetch. Layout and paint grow with the nodes drawn (on 2 busy cores, ~40 nodes paint in
# ~0.5 s and ~400 in ~1.5 s), so a page starts with at most this many and loads the rest on demand.
GRAPH_LIMIT = 150
SEARCH_LIMIT = 30
LABEL_CHARS = 40
TEXT_CHARS = 300
RESULT_FOLD_CHARS = 4000
RESULT_FOLD_LINES = 60
ROLLOUTS_PAGE_SIZE = 50
DIVERGENCES_SHOWN = 20  # per node, the most recent
OVERVIEW_PAGE_SIZE = 50
POOL_TASKS_PAGE_SIZE = 50
SNAPSHOTS_PAGE_SIZE = 50
NODE_SNAPSHOTS_PAGE_SIZE = 20
PROJECT_LIST_PAGE_SIZE = 50
ZERO_RATES = {
    **dict.fromkeys(cache_selectors.COUNTERS, 0),
    "hit_rate": 0.0,
    "oracle_hit_rate": 0.0,
    "state_oracle_hit_rate": 0.0,
}

PATH_SQL = """
WITH RECURSIVE up(id, parent_id, level) AS (
    SELECT id, parent_id, 0 FROM cache_node WHERE task_id = %s AND id = %s
    UNION ALL
    SELECT n.id, n.parent_id, up.level + 1 FROM cache_node n JOIN up ON n.id = up.parent_id
) SELECT id FROM up ORDER BY level DESC
"""


# --- labels ------------------------------------------------------------------------------------


def call_text(call: dict) -> str:
    """The call as a person reads it: the tool and its main argument (or its args)."""
    args = call.get("args") or {}
    strings = [value for value in args.values() if isinstance(value, str)]
    main = strings[0] if len(args) == 1 and strings else json.dumps(args, separators=(",", ":"), sort_keys=True)
    return f"{call.get('tool', '?')}: {main}"


def call_label(call: dict) -> str:
    text = " ".join(call_text(call).split())
    return text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 1] + "…"


# --- overview ----------------------------------------------------------------------------------


def pools(*, project_ids: list[int] | None = None, page: int | str | None = 1) -> dict[str, Any]:
    """The pools page: the engines, fork latency, totals, and one page of the tasks that hold
    live snapshots or sandboxes, one row each (their snapshots are on the task's own page)."""
    listed = Paginator(pool_task_keys(project_ids=project_ids), POOL_TASKS_PAGE_SIZE).get_page(page)
    engine, engines = engines_seen(scoped=project_ids is not None)
    return {
        "engine": engine,
        "engines": engines,
        "fork_latency_ms": fork_latency(project_ids=project_ids),
        "totals": {**pool_totals(project_ids=project_ids), "tasks": listed.paginator.count},
        "tasks": pool_tasks(task_keys=[key for (key,) in listed]),
        "listed": listed,
    }


def pool_task(*, task_id: str, page: int | str | None = 1) -> dict[str, Any]:
    """A task's pools page: its summary row, its sandboxes by pool and state, and one page of its
    live snapshots, newest first."""
    task = cache_selectors.task_get(task_id=task_id)
    snapshots = Paginator(task_live_snapshots(task_id=task_id), SNAPSHOTS_PAGE_SIZE).get_page(page)
    usage = snapshot_usage(snapshot_ids=[row["pk"] for row in snapshots])
    for row in snapshots:
        row.update(usage.get(row["pk"], {"open_leases": 0, "preforks": 0}))
    engine, engines = engines_seen(scoped=True)
    return {
        "engine": engine,
        "engines": engines,
        "fork_latency_ms": fork_latency(task_id=task_id),
        "task": task,
        "summary": pool_tasks(task_keys=[task_id])[0],
        "snapshots": snapshots,
    }


def overview(*, search: str = "", page: int | str | None = 1, project_ids: list[int] | None = None) -> dict[str, Any]:
    """One page of the tasks whose id contains `search`, of the given projects (None: every
    one), each with its totals and its hit rate per epoch: a training run has a task per prompt,
    thousands of them, and the page refreshes live."""
    listed = Paginator(cache_selectors.task_ids(project_ids=project_ids, search=search), OVERVIEW_PAGE_SIZE).get_page(
        page
    )
    return {"tasks": _overview_rows(list(listed)), "listed": listed, "search": search}


def _overview_rows(task_ids: list[str]) -> list[dict[str, Any]]:
    rows = cache_selectors.task_list_stats(task_ids=task_ids)  # first: it writes the buffered lookup counters
    epochs: dict[str, list] = defaultdict(list)
    per_epoch = (
        ToolStat.objects.filter(task_id__in=task_ids)
        .values("task_id", "epoch")
        .annotate(calls=Sum("calls"), hits=Sum("hits"))
        .order_by("task_id", "epoch")
    )
    for row in per_epoch:
        epochs[row["task_id"]].append([row["epoch"], row["calls"], row["hits"]])
    sandboxes = live_sandboxes_per_task(task_keys=task_ids)
    return [
        {
            "id": row["task"].pk,
            "name": row["task"].name,
            "project": row["task"].project.name,
            "backend": (row["task"].env or {}).get("backend", "external"),
            "budget": row["task"].sandbox_budget,
            "stats": row["stats"],
            "nodes": row["nodes"],
            "live_snapshots": row["live_snapshots"],
            "sandboxes": sandboxes.get(row["task"].pk, 0),
            "epochs": epochs.get(row["task"].pk, []),
        }
        for row in rows
    ]


class CountedPaginator(Paginator):
    """A paginator told how many items it pages, where counting them would read every row."""

    def __init__(self, object_list, per_page: int, *, count: int):
        super().__init__(object_list, per_page)
        self._count = count

    @cached_property
    def count(self) -> int:
        return self._count


# --- task --------------------------------------------------------------------------------------


def task_detail(*, task_id: str, rollouts_page: int | str | None = 1) -> dict[str, Any]:
    """The task page: its figures, per tool and per epoch, its divergences, and one page of its
    rollouts, latest first."""
    task = cache_selectors.task_get(task_id=task_id)
    stats = cache_selectors.task_stats(task_id=task_id)
    medians = {
        tool: (row["median_exec_ms"], row["nodes"])
        for tool, row in cache_selectors.task_totals(task_id=task_id).items()
    }
    tools = []
    for row in stats["per_tool"]:
        median, nodes = medians.pop(row["tool"], (None, 0))
        tools.append({**row, "median_exec_ms": median, "nodes": nodes})
    for tool, (median, nodes) in sorted(medians.items()):  # recorded but never looked up
        tools.append({**ZERO_RATES, "tool": tool, "median_exec_ms": median, "nodes": nodes})
    rollouts = CountedPaginator(
        Rollout.objects.filter(task_id=task_id)
        .order_by("-started_at", "-pk")
        .values("rollout_id", "epoch", "calls", "hits", "started_at", "finished_at"),
        ROLLOUTS_PAGE_SIZE,
        count=cache_selectors.task_rollouts_kept(task_id=task_id),
    ).get_page(rollouts_page)
    for rollout in rollouts:
        rollout["misses"] = rollout["calls"] - rollout["hits"]
    divergences = stats["divergences"]
    for row in divergences["per_node"]:
        row["label"] = call_label(row["call"] or {})
    return {
        "task": task,
        "stats": stats,
        "tools": tools,
        "rollouts": rollouts,
        "divergences": divergences,
        "epochs": [[e["epoch"], e["calls"], e["hits"], e["oracle_hits"]] for e in stats["per_epoch"]],
        "processes": stats["processes"],
    }


def task_counts(*, task_id: str) -> dict[str, Any]:
    """What the graph page shows besides the graph: the task and its call, hit and node counts."""
    task = cache_selectors.task_get(task_id=task_id)
    calls = ToolStat.objects.filter(task_id=task_id).aggregate(calls=Sum("calls"), hits=Sum("hits"))
    return {
        "task": task,
        "stats": {
            "calls": calls["calls"] or 0,
            "hits": calls["hits"] or 0,
            "nodes": sum(row["nodes"] for row in cache_selectors.task_totals(task_id=task_id).values()),
        },
    }


# --- graph -------------------------------------------------------------------------------------


def _graph_node(row: dict, children: dict[int, int]) -> dict[str, Any]:
    text = call_text(row["call"])
    return {
        "id": row["id"],
        "parent": row["parent_id"],
        "depth": row["depth"],
        "tool": row["tool"],
        "label": call_label(row["call"]),
        "text": text[:TEXT_CHARS],
        "mutates": row["mutates"],
        "exec_ms": row["exec_ms"],
        "hits": row["hit_count"],
        "pinned": row["pinned"],
        "snapshot": row["snapshot"],
        "children": children.get(row["id"], 0),
        "bytes": row["result_bytes"],
    }


def _child_counts(ids: list[int]) -> dict[int, int]:
    if not ids:
        return {}
    return dict(
        Node.objects.filter(parent_id__in=ids).values("parent_id").annotate(n=Count("id")).values_list("parent_id", "n")
    )


def graph_slice(
    *, task_id: str, root: int | None = None, levels: int = GRAPH_LEVELS, limit: int = GRAPH_LIMIT
) -> dict[str, Any]:
    """A few levels of the graph (from the top, or under `root`), each node with its child count so the
    page knows what it can expand."""
    if root is None:
        data = cache_selectors.graph_export(task_id=task_id, max_depth=levels, limit=limit)
    else:
        data = cache_selectors.graph_export(task_id=task_id, root=root, max_depth=levels, limit=limit + 1)
    rows = data["nodes"]
    children = _child_counts([row["id"] for row in rows])
    top_level = None
    if root is None:
        top_level = sum(row["roots"] for row in cache_selectors.task_totals(task_id=task_id).values())
    return {
        "task_id": task_id,
        "root": root,
        "nodes": [_graph_node(row, children) for row in rows],
        "top_level": top_level,
        "truncated": len(rows) >= limit,
    }


def _rows(task_id: str, query: Q, limit: int) -> list[dict]:
    return cache_selectors.node_rows(
        nodes=Node.objects.filter(query, task_id=task_id),
        limit=limit,
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
            "result_bytes",
        ),
    )


def graph_nodes(*, task_id: str, ids: list[int]) -> list[dict[str, Any]]:
    """Given nodes (new ones announced live), shaped like a slice."""
    rows = _rows(task_id, Q(pk__in=ids[:GRAPH_LIMIT]), GRAPH_LIMIT)
    children = _child_counts([row["id"] for row in rows])
    return [_graph_node(row, children) for row in rows]


def node_path(*, task_id: str, node_id: int) -> list[int]:
    """Node ids from the top of the graph down to the node."""
    with connection.cursor() as cursor:
        cursor.execute(PATH_SQL, [task_id, node_id])
        ids = [row[0] for row in cursor.fetchall()]
    if not ids:
        raise unknown_node(task_id, node_id)
    return ids


def graph_reveal(*, task_id: str, node_id: int) -> dict[str, Any]:
    """What the page needs to show a node deep in the graph: its path, and the children of each node
    on the path (plus the top level), so every node on the way is shown expanded."""
    path = node_path(task_id=task_id, node_id=node_id)
    rows = _rows(task_id, Q(parent__isnull=True) | Q(parent_id__in=path) | Q(pk__in=path), GRAPH_LIMIT * 2)
    children = _child_counts([row["id"] for row in rows])
    return {"task_id": task_id, "path": path, "nodes": [_graph_node(row, children) for row in rows]}


def graph_search(*, task_id: str, text: str) -> list[dict[str, Any]]:
    """Nodes whose call contains the text (case-insensitive)."""
    text = text.strip()
    if not text:
        return []
    rows = _rows(task_id, Q(call__icontains=text), SEARCH_LIMIT)
    return [_graph_node(row, {}) for row in rows]


# --- node --------------------------------------------------------------------------------------


def _folded(text: str) -> dict[str, Any]:
    lines = text.splitlines()
    if len(text) <= RESULT_FOLD_CHARS and len(lines) <= RESULT_FOLD_LINES:
        return {"head": text, "rest": "", "lines": len(lines), "rest_lines": 0}
    head = "\n".join(lines[:RESULT_FOLD_LINES])[:RESULT_FOLD_CHARS]
    rest = text[len(head) :].removeprefix("\n")
    return {"head": head, "rest": rest, "lines": len(lines), "rest_lines": len(rest.splitlines())}


def result_parts(result_json: str) -> list[dict[str, Any]]:
    """The result as folded blocks: long string fields (stdout, output...) as text, the rest as JSON."""
    result = json.loads(result_json)
    parts = []
    if isinstance(result, dict):
        rest = {}
        for key, value in result.items():
            if isinstance(value, str) and ("\n" in value or len(value) > 120):
                parts.append({"name": key, **_folded(value)})
            else:
                rest[key] = value
        if rest:
            parts.insert(0, {"name": "fields", **_folded(json.dumps(rest, indent=2, ensure_ascii=False))})
    else:
        parts.append({"name": "result", **_folded(json.dumps(result, indent=2, ensure_ascii=False))})
    return parts


def node_detail(*, task_id: str, node_id: int, snapshots_page: int | str | None = 1) -> dict[str, Any]:
    """The node page: its call, folded result, path, latest divergences, and one page of its
    snapshots (live and past), latest first."""
    node = Node.objects.defer("file_times").filter(task_id=task_id, pk=node_id).select_related("task").first()
    if node is None:
        raise unknown_node(task_id, node_id)
    path_ids = node_path(task_id=task_id, node_id=node_id)
    labels = dict(Node.objects.filter(pk__in=path_ids).values_list("pk", "call"))
    path = [{"id": pk, "label": call_label(labels[pk])} for pk in path_ids]
    now = timezone.now()
    snapshots = Paginator(
        node.snapshots.order_by("-created_at", "-pk").annotate(
            open_leases=Count("leases", filter=Q(leases__released_at__isnull=True, leases__expires_at__gt=now))
        ),
        NODE_SNAPSHOTS_PAGE_SIZE,
    ).get_page(snapshots_page)
    return {
        "node": node,
        "call_text": call_text(node.call),
        "call_json": json.dumps(node.call, indent=2, ensure_ascii=False),
        "result": result_parts(node.result_json),
        "path": path,
        "children": node.children.count(),
        "snapshots": snapshots,
        "live_snapshot": node.snapshots.filter(status=Snapshot.Status.LIVE).first(),
        "divergences": [
            {
                "kind": d.kind,
                "rollout_id": d.rollout_id,
                "created_at": d.created_at,
                "expected": json.dumps(d.expected, indent=2, ensure_ascii=False),
                "observed": json.dumps(d.observed, indent=2, ensure_ascii=False),
            }
            for d in node.divergences.order_by("-created_at", "-pk")[:DIVERGENCES_SHOWN]
        ],
    }


def subtree_size(*, task_id: str, node_id: int) -> dict[str, int]:
    """What evicting the subtree would remove (for the confirmation page)."""
    ids = cache_selectors.node_subtree_ids(task_id=task_id, node_id=node_id)
    live = Snapshot.objects.filter(node_id__in=ids, status=Snapshot.Status.LIVE)
    leased = Lease.objects.filter(snapshot__in=live, released_at__isnull=True, expires_at__gt=timezone.now()).count()
    return {"nodes": len(ids), "snapshots": live.count(), "leased": leased}


# --- project -----------------------------------------------------------------------------------


def project_detail(
    *, name: str, tokens_page: int | str | None = 1, members_page: int | str | None = 1
) -> dict[str, Any]:
    """A project's grants with its usage against each (live sandboxes, bytes of live snapshots,
    requests per second), a page of its tokens (name, role, state, last used, expiry) and one
    of its members."""
    project = Project.objects.filter(name=name).first()
    if project is None:
        raise NotFound(f"Unknown project '{name}'.", code="unknown_project")
    rate = project_request_rate(project_id=project.pk)
    usage = [
        {
            "what": "Live sandboxes",
            "used": live_sandbox_count(project_id=project.pk),
            "granted": project.max_live_sandboxes,
            "kind": "count",
        },
        {
            "what": "Snapshot bytes",
            "used": cache_selectors.project_snapshot_bytes(project_id=project.pk),
            "granted": project.max_snapshot_bytes,
            "kind": "bytes",
        },
        {
            "what": "Requests per second (last minute)",
            "used": rate["per_s"],
            "granted": project.rate_limit,
            "kind": "rate",
            "refused": rate["refused_last_minute"],
        },
    ]
    for row in usage:
        row["share"] = row["used"] / row["granted"] if row["granted"] else None
    service = settings.TVCACHE
    caps = [
        (
            "Docker network",
            "granted" if project.network else "not granted",
            "allowed" if service["DOCKER_ALLOW_NETWORK"] else "not allowed (TVCACHE_DOCKER_ALLOW_NETWORK)",
        ),
        ("Images", ", ".join(project.images) or "every image the service runs", ", ".join(service_images())),
        ("Memory per sandbox (MB)", project.max_memory_mb or "service maximum", service["DOCKER_MAX_MEMORY_MB"]),
        ("CPUs per sandbox", project.max_cpus or "service maximum", service["DOCKER_MAX_CPUS"]),
        ("Processes per sandbox", project.max_pids or "service maximum", service["DOCKER_MAX_PIDS"]),
        ("Rate burst", project.rate_burst or (project.rate_limit and "one second's worth") or "-", "-"),
    ]
    members = Paginator(
        project.memberships.order_by("user__username", "pk").values("role", username=F("user__username")),
        PROJECT_LIST_PAGE_SIZE,
    ).get_page(members_page)
    # The tokens are read whole (accounts.selectors answers a project's tokens as one list) and shown a page at a time.
    tokens = Paginator(project_tokens(project=project), PROJECT_LIST_PAGE_SIZE).get_page(tokens_page)
    return {
        "project": project,
        "usage": usage,
        "caps": caps,
        "tokens": tokens,
        "members": members,
        "tasks": project.tasks.count(),
        "minutes": rate["minutes"],
    }
