"""Live events: what dashboard pages are told, in which groups, as which messages. The in-process
ledger (`cache.ledger`) collects them from every app and sends them; the dashboard's
websocket consumer joins these groups and only forwards. Nothing else touches the channel layer.

Groups: "dash.overview", "dash.pools" and "dash.task.<task key>" (hashed when too long for a group name);
per project, "dash.overview.p.<project>" and "dash.pools.p.<project>" carry the same summaries cut to
that project's tasks: staff listen to the whole groups, other users to their projects' (consumers).
Messages to browsers are JSON, encoded once per flush:
- task:     {"type": "task", "task_id", "lookups", "hits", "oracle", "saved_ms", "per_epoch": {epoch: [lookups,
             hits, oracle]}, "per_tool": {tool: [lookups, hits, saved_ms, oracle, state hits, state oracle]}, "node_hits": {node_id: n},
             "events": [...], "overflow", "nodes", "snapshots"}  (counts are deltas since the last message)
- overview: {"type": "overview", "tasks": {task_id: {"lookups", "hits", "oracle", "saved_ms", "per_epoch", "nodes",
             "snapshots"}}, "changed": [task_id...]}
- pools:    {"type": "pools", "events": [...]}
Events: {"kind": "node_created", "node_id"}, {"kind": "nodes_removed", "node_ids"}, {"kind": "snapshot",
"event": "created"|"evicted", "node_id", "ref"}, {"kind": "node_changed", "node_id", "pinned"},
{"kind": "task_changed", "what"}, {"kind": "pool", ...}.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import orjson

from accounts.projects import key_project

MAX_EVENTS = 200  # per task per flush; beyond it the page is told to refetch ("overflow")
MAX_NODE_HITS = 500  # distinct nodes per task per flush
OVERVIEW_GROUP = "dash.overview"
POOLS_GROUP = "dash.pools"
PUSH_TYPE = "dashboard.push"  # handled by DashboardConsumer.dashboard_push


def overview_group(project: str | None = None) -> str:
    return OVERVIEW_GROUP if project is None else f"{OVERVIEW_GROUP}.p.{project}"


def pools_group(project: str | None = None) -> str:
    return POOLS_GROUP if project is None else f"{POOLS_GROUP}.p.{project}"


def task_group(task_id: str) -> str:
    name = f"dash.task.{task_id}"
    if len(name) < 90:
        return name
    return "dash.task.h" + hashlib.sha1(task_id.encode()).hexdigest()


class TaskActivity:
    """What happened to one task since the last message: lookup counts and events."""

    __slots__ = (
        "lookups",
        "hits",
        "oracle",
        "saved_ms",
        "per_epoch",
        "per_tool",
        "node_hits",
        "events",
        "overflow",
        "nodes",
        "snapshots",
        "changed",
    )

    def __init__(self) -> None:
        self.lookups = 0
        self.hits = 0
        self.oracle = 0  # lookups whose state and call had been seen (the oracle's hits)
        self.saved_ms = 0.0
        self.per_epoch: dict[int, list[int]] = {}
        self.per_tool: dict[str, list] = {}
        self.node_hits: dict[int, int] = {}
        self.events: list[dict] = []
        self.overflow = False
        self.nodes = 0  # net change of the node count
        self.snapshots = 0  # net change of live snapshots
        self.changed = False  # structural change: the overview refetches its table

    def event(self, event: dict) -> None:
        if len(self.events) < MAX_EVENTS:
            self.events.append(event)
        else:
            self.overflow = True

    def lookups_add(
        self,
        *,
        epoch: int,
        tool: str,
        calls: int,
        hits: int,
        oracle: int,
        saved_ms: float,
        state_hits: int = 0,
        state_oracle: int = 0,
    ) -> None:
        self.lookups += calls
        self.hits += hits
        self.oracle += oracle
        self.saved_ms += saved_ms
        per_epoch = self.per_epoch.setdefault(epoch, [0, 0, 0])
        per_epoch[0] += calls
        per_epoch[1] += hits
        per_epoch[2] += oracle
        per_tool = self.per_tool.setdefault(tool, [0, 0, 0.0, 0, 0, 0])
        per_tool[0] += calls
        per_tool[1] += hits
        per_tool[2] += saved_ms
        per_tool[3] += oracle
        per_tool[4] += state_hits
        per_tool[5] += state_oracle

    def node_hits_add(self, node_id: int, hits: int) -> None:
        if node_id in self.node_hits or len(self.node_hits) < MAX_NODE_HITS:
            self.node_hits[node_id] = self.node_hits.get(node_id, 0) + hits


def messages(tasks: dict[str, TaskActivity], pools: list[dict]) -> list[tuple[str, bytes]]:
    """The (group, JSON text) pairs of one flush: per task, the overview and the pools, and the
    overview and pools of each project with activity (its tasks' only)."""
    out: list[tuple[str, bytes]] = []
    overview: dict[str, dict] = {}
    changed = []
    by_project: dict[str, list[str]] = defaultdict(list)
    for task_id, a in tasks.items():
        out.append(
            (
                task_group(task_id),
                orjson.dumps(
                    {
                        "type": "task",
                        "task_id": task_id,
                        "lookups": a.lookups,
                        "hits": a.hits,
                        "oracle": a.oracle,
                        "saved_ms": a.saved_ms,
                        "per_epoch": a.per_epoch,
                        "per_tool": a.per_tool,
                        "node_hits": a.node_hits,
                        "events": a.events,
                        "overflow": a.overflow,
                        "nodes": a.nodes,
                        "snapshots": a.snapshots,
                    },
                    option=orjson.OPT_NON_STR_KEYS,
                ),
            )
        )
        overview[task_id] = {
            "lookups": a.lookups,
            "hits": a.hits,
            "oracle": a.oracle,
            "saved_ms": a.saved_ms,
            "per_epoch": a.per_epoch,
            "nodes": a.nodes,
            "snapshots": a.snapshots,
        }
        if a.changed:
            changed.append(task_id)
        by_project[key_project(task_id)].append(task_id)
    if overview:
        out.append(
            (
                OVERVIEW_GROUP,
                orjson.dumps(
                    {"type": "overview", "tasks": overview, "changed": changed}, option=orjson.OPT_NON_STR_KEYS
                ),
            )
        )
        for project, keys in by_project.items():
            out.append(
                (
                    overview_group(project),
                    orjson.dumps(
                        {
                            "type": "overview",
                            "tasks": {k: overview[k] for k in keys},
                            "changed": [k for k in changed if k in keys],
                        },
                        option=orjson.OPT_NON_STR_KEYS,
                    ),
                )
            )
    if pools:
        out.append((POOLS_GROUP, orjson.dumps({"type": "pools", "events": pools})))
        pool_projects: dict[str, list[dict]] = defaultdict(list)
        for event in pools:
            if isinstance(event.get("task_id"), str):  # events of no task (engine health) go to staff only
                pool_projects[key_project(event["task_id"])].append(event)
        for project, events in pool_projects.items():
            out.append((pools_group(project), orjson.dumps({"type": "pools", "events": events})))
    return out


async def send(batch: list[tuple[str, bytes]]) -> None:
    from channels.layers import InMemoryChannelLayer, get_channel_layer

    layer = get_channel_layer()
    # The in-memory layer's queues belong to the server's event loop, not to the ledger's thread's:
    # live updates need the Redis layer (REDIS_URL).
    if layer is None or isinstance(layer, InMemoryChannelLayer):
        return
    for group, text in batch:
        await layer.group_send(group, {"type": PUSH_TYPE, "text": text.decode()})
