"""Lookup counters (node hits, per-tool stats, rollout counts), batched in process.

A lookup only reads; its counters go into this buffer and are written in one transaction every
quarter second by a daemon thread (or by `counters_flush()`, which readers of stats call first).
A crash loses at most one interval of counters, never a recorded result: counters are
statistics, and the hot path stays one indexed read (4x cheaper for PostgreSQL than a write).

A batch is written whole or not at all, so one row PostgreSQL refuses would lose everyone's
counters: the edge (cache.inputs) keeps such keys out, the buffer drops any that still come
(logged), and a flush that fails (PostgreSQL restarting) puts its counts back for the next one
(one whose commit was lost with its connection may so count its batch twice: statistics).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import defaultdict

from django.conf import settings
from django.db import transaction

from cache.inputs import INT32, MAX_ID_LENGTH

from .prepared import prepared_cursor

log = logging.getLogger("tvcache.counters")

STATS_SQL = """
INSERT INTO cache_toolstat (task_id, epoch, tool, calls, hits, oracle_hits, executions, executed_ms, saved_ms)
SELECT t.task_id, t.epoch, t.tool, t.calls, t.hits, t.oracle_hits, 0, 0, t.saved_ms
FROM unnest(%s::text[], %s::int[], %s::text[], %s::int[], %s::int[], %s::int[], %s::float8[])
     AS t(task_id, epoch, tool, calls, hits, oracle_hits, saved_ms)
JOIN cache_task ON cache_task.id = t.task_id
ON CONFLICT (task_id, epoch, tool) DO UPDATE SET
    calls = cache_toolstat.calls + EXCLUDED.calls,
    hits = cache_toolstat.hits + EXCLUDED.hits,
    oracle_hits = cache_toolstat.oracle_hits + EXCLUDED.oracle_hits,
    saved_ms = cache_toolstat.saved_ms + EXCLUDED.saved_ms
"""

FLUSH_LOCK_KEY = 0x7476_6361_6368_6531  # "tvcache1": the advisory lock that serializes counter flushes

NODES_SQL = """
UPDATE cache_node SET hit_count = cache_node.hit_count + t.hits, last_hit_at = now()
FROM unnest(%s::bigint[], %s::int[]) AS t(id, hits) WHERE cache_node.id = t.id
"""

ROLLOUTS_SQL = """
INSERT INTO cache_rollout (task_id, rollout_id, epoch, calls, hits, history, started_at)
SELECT t.task_id, t.rollout_id, t.epoch, t.calls, t.hits, '[]'::jsonb, now()
FROM unnest(%s::text[], %s::text[], %s::int[], %s::int[], %s::int[]) AS t(task_id, rollout_id, epoch, calls, hits)
JOIN cache_task ON cache_task.id = t.task_id
ON CONFLICT (task_id, rollout_id) DO UPDATE SET
    calls = cache_rollout.calls + EXCLUDED.calls, hits = cache_rollout.hits + EXCLUDED.hits, epoch = EXCLUDED.epoch
"""


class CounterBuffer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.stats: dict[tuple, list] = defaultdict(lambda: [0, 0, 0, 0.0])
        self.nodes: dict[int, int] = defaultdict(int)
        self.rollouts: dict[tuple, list] = {}

    def add(self, *, task_id: str, epoch: int, tool: str, rollout_id: str, node_id: int | None, hit: bool,
            seen: bool, saved_ms: float) -> None:
        if not _storable(task_id, epoch, tool, rollout_id):
            log.error("counters of a key no column can hold dropped: task %r epoch %r tool %r rollout %r",
                      task_id[:MAX_ID_LENGTH], epoch, tool[:MAX_ID_LENGTH], rollout_id[:MAX_ID_LENGTH])
            return
        with self._lock:
            stat = self.stats[(task_id, epoch, tool)]
            stat[0] += 1
            stat[1] += hit
            stat[2] += seen
            stat[3] += saved_ms if hit else 0.0
            if hit:
                self.nodes[node_id] += 1
            if rollout_id:
                entry = self.rollouts.setdefault((task_id, rollout_id), [0, 0, epoch])
                entry[0] += 1
                entry[1] += hit
                entry[2] = epoch

    def take(self) -> tuple[dict, dict, dict]:
        with self._lock:
            taken = (self.stats, self.nodes, self.rollouts)
            self._reset()
        return taken

    def give_back(self, stats: dict, nodes: dict, rollouts: dict) -> None:
        """Merge counts taken by a flush that failed into what came since (rollout epochs: the
        newer wins)."""
        with self._lock:
            for key, values in stats.items():
                stat = self.stats[key]
                for index, value in enumerate(values):
                    stat[index] += value
            for node_id, hits in nodes.items():
                self.nodes[node_id] += hits
            for key, (calls, hits, epoch) in rollouts.items():
                entry = self.rollouts.setdefault(key, [0, 0, epoch])
                entry[0] += calls
                entry[1] += hits


def _storable(task_id: str, epoch: int, tool: str, rollout_id: str) -> bool:
    """The key fits the columns of the flush's statements (text without NUL, int epoch)."""
    return (INT32[0] <= epoch <= INT32[1] and len(task_id) <= MAX_ID_LENGTH and len(tool) <= MAX_ID_LENGTH
            and len(rollout_id) <= MAX_ID_LENGTH and "\x00" not in task_id + tool + rollout_id)


_buffer = CounterBuffer()
_flusher: tuple[int, threading.Thread] | None = None
_flush_lock = threading.Lock()


def counters_add(**kwargs) -> None:
    _buffer.add(**kwargs)
    _ensure_flusher()


def counters_flush() -> dict:
    """Write the buffered counters; returns what was written (for the live dashboard)."""
    with _flush_lock:
        stats, nodes, rollouts = _buffer.take()
        if not (stats or nodes or rollouts):
            return {}
        try:
            _write(stats, nodes, rollouts)
        except BaseException:
            _buffer.give_back(stats, nodes, rollouts)
            raise
    return {key: value for key, value in stats.items()}


def _write(stats: dict, nodes: dict, rollouts: dict) -> None:
    with transaction.atomic(), prepared_cursor() as cursor:  # the flush runs several times a second
        cursor.execute("SET LOCAL synchronous_commit = off")
        # One flush at a time across processes: each locks many node, stat and rollout rows, in
        # whatever order its batch has, and two of them at once deadlocked under load.
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [FLUSH_LOCK_KEY])
        if stats:
            keys, values = list(stats), list(stats.values())
            cursor.execute(STATS_SQL, [[k[0] for k in keys], [k[1] for k in keys], [k[2] for k in keys],
                                       [v[0] for v in values], [v[1] for v in values], [v[2] for v in values],
                                       [v[3] for v in values]])
        if nodes:
            cursor.execute(NODES_SQL, [list(nodes), list(nodes.values())])
        if rollouts:
            keys, values = list(rollouts), list(rollouts.values())
            cursor.execute(ROLLOUTS_SQL, [[k[0] for k in keys], [k[1] for k in keys], [v[2] for v in values],
                                          [v[0] for v in values], [v[1] for v in values]])


def _ensure_flusher() -> None:
    """Start the flush thread once per process (after a fork, the child starts its own)."""
    global _flusher
    interval = settings.TVCACHE["COUNTER_FLUSH_S"]
    if not interval or (_flusher and _flusher[0] == os.getpid()):
        return
    thread = threading.Thread(target=_flush_forever, args=(interval,), name="tvcache-counters", daemon=True)
    _flusher = (os.getpid(), thread)
    thread.start()


def _flush_forever(interval: float) -> None:
    while True:
        time.sleep(interval)
        try:
            counters_flush()
        except Exception:  # the next interval retries; counters are never worth a crash
            log.exception("counter flush failed")  # a connection that died is dropped by the rollback


@atexit.register
def _final_flush() -> None:
    try:
        counters_flush()
    except Exception:
        log.exception("final counter flush failed")
