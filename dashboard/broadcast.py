"""The one seam that pushes live events to dashboard pages. Nothing else touches the channel layer
(the consumer only forwards what arrives here).

The hot paths (lookup, record) call `lookup()` and `node_created()`: each takes a lock and bumps an
in-process counter or appends to a bounded buffer, a microsecond or two, and never raises. A
daemon thread wakes every FLUSH_INTERVAL_S, swaps the buffers and sends ONE summary message per
subscribed topic (the overview, each task with activity, the pools), so 1,000 lookups/s become
a few messages per second per page. The thread owns one event loop for its whole life, so the
Redis connection pool of channels_redis is reused between flushes. When Redis is down a flush is
dropped (a dashboard counter is not a record: PostgreSQL keeps the real figures) and the thread
backs off; callers never notice.

Groups: "dash.overview", "dash.pools" and "dash.task.<task key>" (hashed when too long for a group name);
per project, "dash.overview.p.<project>" and "dash.pools.p.<project>" carry the same summaries cut to
that project's tasks: staff listen to the whole groups, other users to their projects' (consumers).
Messages to browsers are JSON, encoded once per flush:
- task:     {"type": "task", "task_id", "lookups", "hits", "oracle", "saved_ms", "per_epoch": {epoch: [lookups,
             hits, oracle]}, "per_tool": {tool: [lookups, hits, saved_ms, oracle]}, "node_hits": {node_id: n},
             "events": [...], "overflow", "nodes", "snapshots"}  (counts are deltas since the last message)
- overview: {"type": "overview", "tasks": {task_id: {"lookups", "hits", "oracle", "saved_ms", "per_epoch", "nodes",
             "snapshots"}}, "changed": [task_id...]}
- pools:    {"type": "pools", "events": [...]}
Events: {"kind": "node_created", "node_id"}, {"kind": "nodes_removed", "node_ids"}, {"kind": "snapshot",
"event": "created"|"evicted", "node_id", "ref"}, {"kind": "node_changed", "node_id", "pinned"},
{"kind": "task_changed", "what"}, {"kind": "pool", ...}.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import time
from collections import defaultdict

import orjson

from cache.projects import key_project

logger = logging.getLogger("tvcache.dashboard")

FLUSH_INTERVAL_S = 0.3  # at most ~3 messages per second per page
SEND_TIMEOUT_S = 2.0
BACKOFF_S = 5.0  # after a failed send (Redis down): drop what arrives meanwhile
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


class _TaskActivity:
    __slots__ = ("lookups", "hits", "oracle", "saved_ms", "per_epoch", "per_tool", "node_hits", "events", "overflow",
                 "nodes", "snapshots", "changed")

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


class _Hub:
    """Per-process buffers plus the flusher thread (restarted in a forked worker)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tasks: dict[str, _TaskActivity] = {}
        self.pool_events: list[dict] = []
        self.pid: int | None = None
        self.wake = threading.Event()
        self.paused_until = 0.0

    def activity(self, task_id: str) -> _TaskActivity:
        # Callers hold the lock.
        if self.pid != os.getpid():
            self._start()
        activity = self.tasks.get(task_id)
        if activity is None:
            activity = self.tasks[task_id] = _TaskActivity()
        return activity

    def _start(self) -> None:
        self.pid = os.getpid()
        self.tasks, self.pool_events = {}, []
        threading.Thread(target=self._run, name="dashboard-broadcast", daemon=True).start()

    def take(self) -> tuple[dict[str, _TaskActivity], list[dict]]:
        with self.lock:
            tasks, pools = self.tasks, self.pool_events
            self.tasks, self.pool_events = {}, []
        return tasks, pools

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        while True:
            self.wake.wait(FLUSH_INTERVAL_S)
            self.wake.clear()
            tasks, pools = self.take()
            if (not tasks and not pools) or time.monotonic() < self.paused_until:
                continue
            try:
                loop.run_until_complete(asyncio.wait_for(_send(messages(tasks, pools)), SEND_TIMEOUT_S))
            except Exception as exc:  # Redis down or slow: drop this flush, back off, never stop
                self.paused_until = time.monotonic() + BACKOFF_S
                logger.warning("dashboard broadcast dropped a flush: %r", exc)


_hub = _Hub()


# --- what the rest of the service calls -------------------------------------------------------

def lookup(task_id: str, hit: bool, *, oracle: bool | None = None, epoch: int = 0, tool: str = "",
           node_id: int | None = None, saved_ms: float = 0.0) -> None:
    """One lookup answered (hot path: counters only). `oracle`: the state and call had been seen
    (a node exists, cacheable or not); defaults to `hit`."""
    try:
        seen = hit if oracle is None else oracle
        with _hub.lock:
            a = _hub.activity(task_id)
            a.lookups += 1
            per_epoch = a.per_epoch.get(epoch)
            if per_epoch is None:
                per_epoch = a.per_epoch[epoch] = [0, 0, 0]
            per_epoch[0] += 1
            per_tool = a.per_tool.get(tool)
            if per_tool is None:
                per_tool = a.per_tool[tool] = [0, 0, 0.0, 0]
            per_tool[0] += 1
            if seen:
                a.oracle += 1
                per_epoch[2] += 1
                per_tool[3] += 1
            if hit:
                a.hits += 1
                a.saved_ms += saved_ms
                per_epoch[1] += 1
                per_tool[1] += 1
                per_tool[2] += saved_ms
                if node_id is not None and (node_id in a.node_hits or len(a.node_hits) < MAX_NODE_HITS):
                    a.node_hits[node_id] = a.node_hits.get(node_id, 0) + 1
    except Exception:  # never into the caller
        pass


def node_created(task_id: str, node_id: int) -> None:
    """A new node was recorded (hot path)."""
    _task_event(task_id, {"kind": "node_created", "node_id": node_id}, nodes=1)


def nodes_removed(task_id: str, node_ids: list[int]) -> None:
    _after_commit(lambda: _task_event(task_id, {"kind": "nodes_removed", "node_ids": list(node_ids)},
                                      nodes=-len(node_ids), changed=True))


def snapshot_event(task_id: str, kind: str, *, node_id: int | None = None, ref: str = "",
                   snapshot_id: int | None = None) -> None:
    """A snapshot was created ("created") or evicted ("evicted")."""
    event = {"kind": "snapshot", "event": kind, "node_id": node_id, "ref": ref, "snapshot_id": snapshot_id}
    delta = {"created": 1, "evicted": -1}.get(kind, 0)

    def push() -> None:
        _task_event(task_id, event, snapshots=delta)
        _pool_event({**event, "task_id": task_id})

    _after_commit(push)


def node_changed(task_id: str, node_id: int, **fields) -> None:
    """A node's flags changed (pinned)."""
    _after_commit(lambda: _task_event(task_id, {"kind": "node_changed", "node_id": node_id, **fields}))


def task_changed(task_id: str, what: str) -> None:
    """A task was created, flushed, or its budget or environment changed: pages refetch."""
    _after_commit(lambda: _task_event(task_id, {"kind": "task_changed", "what": what}, changed=True))


def pool_changed(**details) -> None:
    """Sandboxes changed state in a pool (warming, ready, leased, stopping) or the engine's health changed."""
    _after_commit(lambda: _pool_event({"kind": "pool", **details}))


def flush_now() -> None:
    """Ask the flusher for an immediate flush (tests and shutdown; not needed in normal operation)."""
    _hub.wake.set()


# --- internals -------------------------------------------------------------------------------

def _task_event(task_id: str, event: dict, *, nodes: int = 0, snapshots: int = 0, changed: bool = False) -> None:
    try:
        with _hub.lock:
            a = _hub.activity(task_id)
            a.event(event)
            a.nodes += nodes
            a.snapshots += snapshots
            a.changed = a.changed or changed
    except Exception:
        pass


def _pool_event(event: dict) -> None:
    try:
        with _hub.lock:
            if _hub.pid != os.getpid():
                _hub._start()
            if len(_hub.pool_events) < MAX_EVENTS:
                _hub.pool_events.append(event)
    except Exception:
        pass


def _after_commit(push) -> None:
    """Push once the surrounding transaction commits (at once outside one); a rolled-back change
    is never announced."""
    try:
        from django.db import connection, transaction

        if connection.in_atomic_block:  # read without opening a connection (any thread may call this)
            transaction.on_commit(push)
            return
    except Exception:
        pass
    push()


def messages(tasks: dict[str, _TaskActivity], pools: list[dict]) -> list[tuple[str, bytes]]:
    """The (group, JSON text) pairs of one flush: per task, the overview and the pools, and the
    overview and pools of each project with activity (its tasks' only)."""
    out: list[tuple[str, bytes]] = []
    overview: dict[str, dict] = {}
    changed = []
    by_project: dict[str, list[str]] = defaultdict(list)
    for task_id, a in tasks.items():
        out.append((task_group(task_id), orjson.dumps({
            "type": "task", "task_id": task_id, "lookups": a.lookups, "hits": a.hits, "oracle": a.oracle,
            "saved_ms": a.saved_ms,
            "per_epoch": a.per_epoch, "per_tool": a.per_tool, "node_hits": a.node_hits, "events": a.events,
            "overflow": a.overflow, "nodes": a.nodes, "snapshots": a.snapshots,
        }, option=orjson.OPT_NON_STR_KEYS)))
        overview[task_id] = {"lookups": a.lookups, "hits": a.hits, "oracle": a.oracle, "saved_ms": a.saved_ms,
                             "per_epoch": a.per_epoch,
                             "nodes": a.nodes, "snapshots": a.snapshots}
        if a.changed:
            changed.append(task_id)
        by_project[key_project(task_id)].append(task_id)
    if overview:
        out.append((OVERVIEW_GROUP, orjson.dumps({"type": "overview", "tasks": overview, "changed": changed},
                                                 option=orjson.OPT_NON_STR_KEYS)))
        for project, keys in by_project.items():
            out.append((overview_group(project), orjson.dumps(
                {"type": "overview", "tasks": {k: overview[k] for k in keys}, "changed": [k for k in changed if k in keys]},
                option=orjson.OPT_NON_STR_KEYS)))
    if pools:
        out.append((POOLS_GROUP, orjson.dumps({"type": "pools", "events": pools})))
        pool_projects: dict[str, list[dict]] = defaultdict(list)
        for event in pools:
            if isinstance(event.get("task_id"), str):  # events of no task (engine health) go to staff only
                pool_projects[key_project(event["task_id"])].append(event)
        for project, events in pool_projects.items():
            out.append((pools_group(project), orjson.dumps({"type": "pools", "events": events})))
    return out


async def _send(batch: list[tuple[str, bytes]]) -> None:
    from channels.layers import InMemoryChannelLayer, get_channel_layer

    layer = get_channel_layer()
    # The in-memory layer's queues belong to the server's event loop, not to this thread's:
    # live updates need the Redis layer (REDIS_URL).
    if layer is None or isinstance(layer, InMemoryChannelLayer):
        return
    for group, text in batch:
        await layer.group_send(group, {"type": PUSH_TYPE, "text": text.decode()})
