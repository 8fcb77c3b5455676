"""The in-process ledger: what this process counted and announced since the last flush, and the one
thread that flushes it.

The hot paths only write here: a lookup adds its counts (node hits, per-tool stats, rollout
counts; `lookup_add`), an API request its project's (`request_add`), a record its event
(`node_created`): a lock and a few dict updates, never a statement. Every FLUSH_INTERVAL_S (or
at `flush_now`) a daemon thread, restarted in a forked child, takes what came. The same lookup
deltas then go two ways:

- to PostgreSQL, in one transaction, every TVCACHE["COUNTER_FLUSH_S"] (checked each interval; 0:
  only when stats are read, which call `ledger_flush` first). A crash loses at most that long of
  counters, never a recorded result: counters are statistics, and the lookup stays one indexed
  read (4x cheaper for PostgreSQL than a write). A batch is written whole or not at all, so one
  row PostgreSQL refuses would lose everyone's counters: the edge (core.inputs) keeps such keys
  out, `lookup_add` drops any that still come (logged), and a write that fails (PostgreSQL
  restarting) keeps its counts for the next one (one whose commit was lost with its connection
  may so count its batch twice: statistics).
- to the dashboards, with the events of the interval, as ONE summary message per subscribed
  topic (`cache.events`), so 1,000 lookups/s become a few messages per second per page. The
  thread owns one event loop for its whole life, so the Redis connection pool of channels_redis
  is reused between sends. When Redis is down a send is dropped (a dashboard counter is not a
  record: PostgreSQL keeps the real figures) and the thread backs off; callers never notice.

Events other than the hot paths' are taken after the surrounding transaction commits (a
rolled-back change is never announced).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time

import orjson
from django.conf import settings
from django.db import connection, transaction

from accounts.projects import MAX_TASK_KEY
from cache import events
from cache.prepared import prepared_cursor
from cache.tcg.records import NO_TRACE, Trace
from core.inputs import INT32, MAX_ID_LENGTH
from observability import metrics

log = logging.getLogger("tvcache.ledger")

FLUSH_INTERVAL_S = 0.3  # at most ~3 messages per second per page
SEND_TIMEOUT_S = 2.0
BACKOFF_S = 5.0  # after a failed send (Redis down): drop what arrives meanwhile

STATS_SQL = """
INSERT INTO cache_toolstat (task_id, epoch, tool, calls, hits, oracle_hits, executions, executed_ms, saved_ms,
                            state_hits, state_oracle_hits)
SELECT t.task_id, t.epoch, t.tool, t.calls, t.hits, t.oracle_hits, 0, 0, t.saved_ms, t.state_hits, t.state_oracle_hits
FROM unnest(%s::text[], %s::int[], %s::text[], %s::int[], %s::int[], %s::int[], %s::float8[], %s::int[], %s::int[])
     AS t(task_id, epoch, tool, calls, hits, oracle_hits, saved_ms, state_hits, state_oracle_hits)
JOIN cache_task ON cache_task.id = t.task_id
ON CONFLICT (task_id, epoch, tool) DO UPDATE SET
    calls = cache_toolstat.calls + EXCLUDED.calls,
    hits = cache_toolstat.hits + EXCLUDED.hits,
    oracle_hits = cache_toolstat.oracle_hits + EXCLUDED.oracle_hits,
    saved_ms = cache_toolstat.saved_ms + EXCLUDED.saved_ms,
    state_hits = cache_toolstat.state_hits + EXCLUDED.state_hits,
    state_oracle_hits = cache_toolstat.state_oracle_hits + EXCLUDED.state_oracle_hits
"""

FLUSH_LOCK_KEY = 0x7476_6361_6368_6531  # "tvcache1": the advisory lock that serializes counter flushes


def counters_quiet() -> None:
    """Waits for a counter flush in flight and keeps the next one out until the caller's transaction
    ends. Work that deletes counted rows in bulk (nodes, rollouts, tool stats) takes it first, before
    any row lock: a flush locks those rows in its batch's order, a delete in the table's, and the two
    deadlocked under load (the delete then failed with 503)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [FLUSH_LOCK_KEY])


NODES_SQL = """
UPDATE cache_node SET hit_count = cache_node.hit_count + t.hits, last_hit_at = now()
FROM unnest(%s::bigint[], %s::int[]) AS t(id, hits) WHERE cache_node.id = t.id
"""

ROLLOUTS_SQL = """
INSERT INTO cache_rollout (task_id, rollout_id, epoch, calls, hits, history_length, started_at, trajectory_ref,
                           branch_of, branch_step, branch_tokens)
SELECT t.task_id, t.rollout_id, t.epoch, t.calls, t.hits, 0, now(), t.ref, t.branch_of, t.branch_step,
       t.branch_tokens::jsonb
FROM unnest(%s::text[], %s::text[], %s::int[], %s::int[], %s::int[], %s::text[], %s::text[], %s::int[], %s::text[])
     AS t(task_id, rollout_id, epoch, calls, hits, ref, branch_of, branch_step, branch_tokens)
JOIN cache_task ON cache_task.id = t.task_id
ON CONFLICT (task_id, rollout_id) DO UPDATE SET
    calls = cache_rollout.calls + EXCLUDED.calls, hits = cache_rollout.hits + EXCLUDED.hits, epoch = EXCLUDED.epoch,
    trajectory_ref = CASE WHEN EXCLUDED.trajectory_ref = '' THEN cache_rollout.trajectory_ref
                          ELSE EXCLUDED.trajectory_ref END,
    branch_step = CASE WHEN cache_rollout.branch_of = '' THEN EXCLUDED.branch_step ELSE cache_rollout.branch_step END,
    branch_tokens = CASE WHEN cache_rollout.branch_of = '' THEN EXCLUDED.branch_tokens
                         ELSE cache_rollout.branch_tokens END,
    branch_of = CASE WHEN cache_rollout.branch_of = '' THEN EXCLUDED.branch_of ELSE cache_rollout.branch_of END
"""

# The rollouts' steps (cache.models.RolloutStep), after ROLLOUTS_SQL has made their rollouts.
STEPS_SQL = """
INSERT INTO cache_rolloutstep (rollout_id, applied, seq, at, node_id, hit, tokens)
SELECT r.id, t.applied, t.seq, t.at, t.node_id, t.hit, t.tokens::jsonb
FROM unnest(%s::text[], %s::text[], %s::int[], %s::int[], %s::bigint[], %s::bigint[], %s::bool[], %s::text[])
     AS t(task_id, rollout_id, applied, seq, at, node_id, hit, tokens)
JOIN cache_rollout r ON r.task_id = t.task_id AND r.rollout_id = t.rollout_id
"""

# API requests per project and minute (accounts.services.tokens.admit, through accounts.hooks): the
# project page's request rate (accounts.models.ProjectRequests).
REQUESTS_SQL = """
INSERT INTO accounts_projectrequests (project_id, minute, admitted, refused)
SELECT t.project_id, date_trunc('minute', now()), t.admitted, t.refused
FROM unnest(%s::bigint[], %s::int[], %s::int[]) AS t(project_id, admitted, refused)
JOIN accounts_project ON accounts_project.id = t.project_id
ON CONFLICT (project_id, minute) DO UPDATE SET
    admitted = accounts_projectrequests.admitted + EXCLUDED.admitted,
    refused = accounts_projectrequests.refused + EXCLUDED.refused
"""


# How tool-server misses materialized their sandboxes (cache.models.MaterializationStat).
MATERIALIZED_SQL = """
INSERT INTO cache_materializationstat (task_id, how, processes, count)
SELECT t.task_id, t.how, t.processes, t.count
FROM unnest(%s::text[], %s::text[], %s::bool[], %s::int[]) AS t(task_id, how, processes, count)
JOIN cache_task ON cache_task.id = t.task_id
ON CONFLICT (task_id, how, processes) DO UPDATE SET count = cache_materializationstat.count + EXCLUDED.count
"""


def _stat() -> list:
    """A (task, epoch, tool)'s lookup counts: calls, hits, oracle hits, saved ms, state-keyed hits,
    state oracle hits."""
    return [0, 0, 0, 0.0, 0, 0]


class Counts:
    """Lookup and request counts, as deltas."""

    __slots__ = ("stats", "nodes", "rollouts", "steps", "requests", "materialized")

    def __init__(self) -> None:
        # (task, epoch, tool) -> [calls, hits, oracle, saved_ms, state hits, state oracle] (_stat)
        self.stats: dict[tuple[str, int, str], list] = {}
        self.nodes: dict[tuple[str, int], int] = {}  # (task, node id) -> hits
        # (task, rollout) -> [calls, hits, epoch, trajectory ref, branch of, branch step, branch tokens (JSON)]
        self.rollouts: dict[tuple[str, str], list] = {}
        self.steps: list[tuple] = []  # (task, rollout, applied, seq, at, node id, hit, tokens (JSON))
        self.requests: dict[int, list[int]] = {}  # project id -> [admitted, refused]
        self.materialized: dict[tuple[str, str, bool], int] = {}  # (task, how, processes) -> misses

    def __bool__(self) -> bool:
        return bool(self.stats or self.nodes or self.rollouts or self.requests or self.materialized)

    def rollout(self, task_id: str, rollout_id: str, epoch: int, trace: Trace) -> list:
        entry = self.rollouts.get((task_id, rollout_id))
        if entry is None:
            entry = self.rollouts[(task_id, rollout_id)] = [0, 0, epoch, "", "", None, None]
        entry[2] = epoch
        _traced(entry, trace)
        return entry

    def merge(self, other: Counts) -> None:
        """Add `other`'s counts (rollout epochs: `other`'s, the newer, win)."""
        for key, values in other.stats.items():
            stat = self.stats.setdefault(key, _stat())
            for index, value in enumerate(values):
                stat[index] += value
        for key, hits in other.nodes.items():
            self.nodes[key] = self.nodes.get(key, 0) + hits
        for key, (calls, hits, epoch, *traced) in other.rollouts.items():
            entry = self.rollouts.setdefault(key, [0, 0, epoch, "", "", None, None])
            entry[0] += calls
            entry[1] += hits
            entry[2] = epoch
            if traced[0]:
                entry[3] = traced[0]
            if traced[1] and not entry[4]:
                entry[4:] = traced[1:]
        self.steps.extend(other.steps)
        for project_id, (admitted, refused) in other.requests.items():
            counts = self.requests.setdefault(project_id, [0, 0])
            counts[0] += admitted
            counts[1] += refused
        for key, count in other.materialized.items():
            self.materialized[key] = self.materialized.get(key, 0) + count

    def write(self) -> None:
        with transaction.atomic(), prepared_cursor() as cursor:  # the flush runs several times a second
            cursor.execute("SET LOCAL synchronous_commit = off")
            # One flush at a time across processes: each locks many node, stat and rollout rows, in
            # whatever order its batch has, and two of them at once deadlocked under load. Rollouts
            # before stats, as a tool-server miss's record locks them (its history grows, then its
            # execution counts: record.record_sql); the other order deadlocked with it.
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [FLUSH_LOCK_KEY])
            if self.rollouts:
                keys, values = list(self.rollouts), list(self.rollouts.values())
                cursor.execute(
                    ROLLOUTS_SQL,
                    [
                        [k[0] for k in keys],
                        [k[1] for k in keys],
                        *([v[i] for v in values] for i in (2, 0, 1, 3, 4, 5, 6)),
                    ],
                )
            if self.stats:
                keys, values = list(self.stats), list(self.stats.values())
                cursor.execute(
                    STATS_SQL,
                    [
                        [k[0] for k in keys],
                        [k[1] for k in keys],
                        [k[2] for k in keys],
                        [v[0] for v in values],
                        [v[1] for v in values],
                        [v[2] for v in values],
                        [v[3] for v in values],
                        [v[4] for v in values],
                        [v[5] for v in values],
                    ],
                )
            if self.nodes:
                cursor.execute(NODES_SQL, [[k[1] for k in self.nodes], list(self.nodes.values())])
            if self.steps:
                cursor.execute(STEPS_SQL, [list(column) for column in zip(*self.steps)])
            if self.requests:
                cursor.execute(
                    REQUESTS_SQL,
                    [
                        list(self.requests),
                        [v[0] for v in self.requests.values()],
                        [v[1] for v in self.requests.values()],
                    ],
                )
            if self.materialized:
                keys = list(self.materialized)
                cursor.execute(
                    MATERIALIZED_SQL,
                    [
                        [k[0] for k in keys],
                        [k[1] for k in keys],
                        [k[2] for k in keys],
                        list(self.materialized.values()),
                    ],
                )


def _storable(task_id: str, epoch: int, tool: str, rollout_id: str) -> bool:
    """The key fits the columns of the flush's statements (text without NUL, int epoch)."""
    return (
        INT32[0] <= epoch <= INT32[1]
        and len(task_id) <= MAX_TASK_KEY
        and len(tool) <= MAX_ID_LENGTH
        and len(rollout_id) <= MAX_ID_LENGTH
        and "\x00" not in task_id + tool + rollout_id
    )


class _Ledger:
    def __init__(self) -> None:
        self.lock = threading.Lock()  # what the callers write (fresh counts, events)
        self.flush_lock = threading.Lock()  # what is taken and not yet written (unwritten)
        self.pid: int | None = None
        self.wake = threading.Event()
        self.paused_until = 0.0
        self.written_at = 0.0
        self._reset()

    def _reset(self) -> None:
        self.fresh = Counts()  # since the last take
        self.counted: list[Counts] = []  # taken, for the next send
        self.tasks: dict[str, events.TaskActivity] = {}
        self.pools: list[dict] = []
        self.unwritten = Counts()  # taken, not yet written to PostgreSQL

    def started(self) -> None:
        # Callers hold the lock. A forked child starts afresh: its parent flushes what it holds.
        if self.pid != metrics.process_id():
            self.pid = metrics.process_id()
            self._reset()
            threading.Thread(target=self._run, name="tvcache-ledger", daemon=True).start()

    def activity(self, task_id: str) -> events.TaskActivity:
        # Callers hold the lock.
        self.started()
        activity = self.tasks.get(task_id)
        if activity is None:
            activity = self.tasks[task_id] = events.TaskActivity()
        return activity

    def flush(self, *, write: bool = True) -> None:
        """Take the fresh counts (queued for the next send as they are), add them to the unwritten
        ones and, with `write`, write those; a write that fails keeps them and raises."""
        with self.lock:
            if self.pid != metrics.process_id():  # nothing counted here (a forked child holds its parent's counts)
                return
            taken, self.fresh = self.fresh, Counts()
            if taken:
                self.counted.append(taken)
        for (_, _, tool), (calls, hits, *_) in taken.stats.items():  # /metrics' lookups, counted once
            metrics.lookups_counted(tool=tool, hits=hits, misses=calls - hits)
        metrics.lookup_times_flush()
        with self.flush_lock:
            self.unwritten.merge(taken)
            if write and self.unwritten:
                self.unwritten.write()
                self.unwritten = Counts()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        while True:
            self.wake.wait(FLUSH_INTERVAL_S)
            self.wake.clear()
            interval = settings.TVCACHE.get("COUNTER_FLUSH_S", 0)
            due = bool(interval) and time.monotonic() - self.written_at >= interval
            if due:
                self.written_at = time.monotonic()
            try:
                self.flush(write=due)
            except Exception:  # the next interval retries; counters are never worth a crash
                log.exception("counter flush failed")  # a connection that died is dropped by the rollback
            self._send(loop)

    def _send(self, loop: asyncio.AbstractEventLoop) -> None:
        with self.lock:
            counted, tasks, pools = self.counted, self.tasks, self.pools
            self.counted, self.tasks, self.pools = [], {}, []
        if time.monotonic() < self.paused_until:
            return
        for counts in counted:
            for (task_id, epoch, tool), (
                calls,
                hits,
                oracle,
                saved_ms,
                state_hits,
                state_oracle,
            ) in counts.stats.items():
                tasks.setdefault(task_id, events.TaskActivity()).lookups_add(
                    epoch=epoch,
                    tool=tool,
                    calls=calls,
                    hits=hits,
                    oracle=oracle,
                    saved_ms=saved_ms,
                    state_hits=state_hits,
                    state_oracle=state_oracle,
                )
            for (task_id, node_id), hits in counts.nodes.items():
                tasks[task_id].node_hits_add(node_id, hits)
        if not tasks and not pools:
            return
        try:
            loop.run_until_complete(asyncio.wait_for(events.send(events.messages(tasks, pools)), SEND_TIMEOUT_S))
        except Exception as exc:  # Redis down or slow: drop this send, back off, never stop
            self.paused_until = time.monotonic() + BACKOFF_S
            log.warning("live events dropped: %r", exc)


_ledger = _Ledger()


# --- what the rest of the service calls -------------------------------------------------------


def lookup_add(
    *,
    task_id: str,
    epoch: int,
    tool: str,
    rollout_id: str,
    node_id: int | None,
    hit: bool,
    seen: bool,
    saved_ms: float,
    applied: int = 0,
    trace: Trace = NO_TRACE,
    state_seen: bool = False,
    via_state: bool = False,
) -> None:
    """One lookup answered (hot path). `seen`: the state and call had been seen (a node exists,
    cacheable or not: the oracle's hit); `state_seen`: by history or from a state with the same
    verified fingerprint (the state oracle's hit); `via_state`: a state-keyed hit. A rollout's hit
    is a step of its path, after `applied` state-changing calls."""
    if not _storable(task_id, epoch, tool, rollout_id):
        log.error(
            "counters of a key no column can hold dropped: task %r epoch %r tool %r rollout %r",
            task_id[:MAX_ID_LENGTH],
            epoch,
            tool[:MAX_ID_LENGTH],
            rollout_id[:MAX_ID_LENGTH],
        )
        return
    with _ledger.lock:
        _ledger.started()
        counts = _ledger.fresh
        stat = counts.stats.get((task_id, epoch, tool))
        if stat is None:
            stat = counts.stats[(task_id, epoch, tool)] = _stat()
        stat[0] += 1
        stat[1] += hit
        stat[2] += seen
        stat[4] += via_state
        stat[5] += state_seen
        if hit:
            stat[3] += saved_ms
            if node_id is not None:
                key = (task_id, node_id)
                counts.nodes[key] = counts.nodes.get(key, 0) + 1
        if rollout_id:
            entry = counts.rollout(task_id, rollout_id, epoch, trace)
            entry[0] += 1
            entry[1] += hit
            if hit and node_id is not None:
                counts.steps.append(_step(task_id, rollout_id, applied, trace, node_id, hit=True))


def step_add(*, task_id: str, rollout_id: str, epoch: int, applied: int, trace: Trace, node_id: int) -> None:
    """A rollout's call recorded as `node_id` (hot path): a step of its path. Its hits are steps
    of `lookup_add`."""
    if not rollout_id or not _storable(task_id, epoch, "", rollout_id):
        return
    with _ledger.lock:
        _ledger.started()
        counts = _ledger.fresh
        counts.rollout(task_id, rollout_id, epoch, trace)
        counts.steps.append(_step(task_id, rollout_id, applied, trace, node_id, hit=False))


def _step(task_id: str, rollout_id: str, applied: int, trace: Trace, node_id: int, *, hit: bool) -> tuple:
    tokens = None if trace.tokens is None else orjson.dumps(trace.tokens).decode()
    return (task_id, rollout_id, applied, trace.seq, time.time_ns(), node_id, hit, tokens)


def _traced(entry: list, trace: Trace) -> None:
    """What a call's trace says of its rollout: its trajectory (the latest given), and where a
    branch started (the first given)."""
    if trace is NO_TRACE:
        return
    if trace.ref:
        entry[3] = trace.ref
    if trace.branch_of is not None and not entry[4]:
        rollout, step, tokens = trace.branch_of
        entry[4:] = [rollout, step, None if tokens is None else orjson.dumps(tokens).decode()]


def replay_add(*, task_id: str, epoch: int, tool: str, ms: float) -> None:
    """A call run again only to rebuild a sandbox's state: the time a hit of it saved was spent
    after all, so it comes off `saved_ms`."""
    if not _storable(task_id, epoch, tool, ""):
        return
    with _ledger.lock:
        _ledger.started()
        stat = _ledger.fresh.stats.setdefault((task_id, epoch, tool), _stat())
        stat[3] -= ms


def materialized_add(*, task_id: str, how: str, processes: bool) -> None:
    """A tool-server miss got its sandbox to its history's state this way (MaterializationStat.How);
    `processes`: that state had live processes."""
    if not _storable(task_id, 0, how, ""):
        return
    with _ledger.lock:
        _ledger.started()
        key = (task_id, how, bool(processes))
        _ledger.fresh.materialized[key] = _ledger.fresh.materialized.get(key, 0) + 1


def request_add(*, project_id: int, admitted: bool) -> None:
    """One API request of the project, admitted or refused by its rate limit."""
    with _ledger.lock:
        _ledger.started()
        counts = _ledger.fresh.requests.get(project_id)
        if counts is None:
            counts = _ledger.fresh.requests[project_id] = [0, 0]
        counts[0 if admitted else 1] += 1


def ledger_flush(*, write: bool = True) -> None:
    """Write the counts this process holds (readers of stats call it first). Raises if the write
    fails; the counts stay for the next one. Without `write`, only /metrics' counters are brought
    up to date (the ledger's thread writes the rest as usual)."""
    _ledger.flush(write=write)


def node_created(task_id: str, node_id: int) -> None:
    """A new node was recorded (hot path)."""
    _task_event(task_id, {"kind": "node_created", "node_id": node_id}, nodes=1)


def nodes_removed(task_id: str, node_ids: list[int]) -> None:
    _after_commit(
        lambda: _task_event(
            task_id, {"kind": "nodes_removed", "node_ids": list(node_ids)}, nodes=-len(node_ids), changed=True
        )
    )


def snapshot_event(
    task_id: str, kind: str, *, node_id: int | None = None, ref: str = "", snapshot_id: int | None = None
) -> None:
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
    """Ask the thread for an immediate flush (tests and shutdown; not needed in normal operation)."""
    _ledger.wake.set()


# --- internals -------------------------------------------------------------------------------


def _task_event(task_id: str, event: dict, *, nodes: int = 0, snapshots: int = 0, changed: bool = False) -> None:
    try:
        with _ledger.lock:
            a = _ledger.activity(task_id)
            a.event(event)
            a.nodes += nodes
            a.snapshots += snapshots
            a.changed = a.changed or changed
    except Exception:
        pass


def _pool_event(event: dict) -> None:
    try:
        with _ledger.lock:
            _ledger.started()
            if len(_ledger.pools) < events.MAX_EVENTS:
                _ledger.pools.append(event)
    except Exception:
        pass


def _after_commit(push) -> None:
    """Push once the surrounding transaction commits (at once outside one)."""
    try:
        if connection.in_atomic_block:  # read without opening a connection (any thread may call this)
            transaction.on_commit(push)
            return
    except Exception:
        pass
    push()


@atexit.register
def _final_flush() -> None:
    try:
        ledger_flush()
    except Exception:
        log.exception("final counter flush failed")
