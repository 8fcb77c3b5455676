"""The process's cache of hit answers: a hit served again without a statement, and never one that a
change already answered has made unservable.

An entry is a hit's answer (node id, result, exec_ms, mutates) under (task, anchor key, call
digest), tagged with the task's stamp (version and creation time) that the statement reading it
returned; misses are never kept. A node's result never changes; what can make a hit unservable
is the task's version moving: a changed env or tool policy, a flush, a node marked divergent (and
the nodes below a divergent write), a tool made uncacheable, a subtree evicted
(`tasks.task_version_move`, the one place that moves it).

Version leases. The process serves an entry only while it holds a lease on the task's current
stamp: the stamp read from PostgreSQL by a statement sent at local monotonic time r0, valid
until r0 + W (TVCACHE_HIT_CACHE_WINDOW_MS), and equal to the entry's. A lease is renewed by every
lookup statement (it returns the task's version) or, when an entry waits and the lease has lapsed,
by one prepared read of the task's row by its key. A version move waits W after its commit
before its caller gets an answer. So a lookup that arrives after that answer is served from an
entry only under a lease whose read was sent after the commit: that read saw the new version,
which no entry filled earlier carries. Lookups that arrive while the change is in flight may be
served either way, as they may by the database.

The creation time is part of the stamp so that a task deleted and created again under the same
key (the tests do, every test starting from an empty database) never matches an entry of the
old one at version 1.

Bounded by entries and by the bytes of their results (least recently served out first);
TVCACHE_HIT_CACHE_ENTRIES = 0 turns it off. Each process and each window costs one statement per
task at most, whatever the rate of lookups.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from datetime import datetime
from typing import NamedTuple

from django.conf import settings

# What an entry and a lease are valid under: the task's version and its creation time.
TaskStamp = tuple[int, datetime]


class CachedHit(NamedTuple):
    node_id: int
    result_json: str
    exec_ms: float
    mutates: bool


class HitCache:
    """Entries (LRU, bounded by count and result bytes) and leases, shared by the process's threads."""

    def __init__(self, *, entries: int, max_bytes: int, window_s: float):
        self.max_entries, self.max_bytes, self.window_s = entries, max_bytes, window_s
        self._entries: OrderedDict[tuple[str, str, str], tuple[TaskStamp, CachedHit]] = OrderedDict()
        self._bytes = 0
        self._leases: dict[str, tuple[TaskStamp, float]] = {}  # task -> (stamp, valid until, monotonic)
        self._renewing: set[str] = set()  # tasks whose lease a read is renewing (renewal_due)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.window_s > 0

    def leased(self, task_id: str) -> TaskStamp | None:
        """The task's stamp, if a read of it sent less than W ago said so."""
        lease = self._leases.get(task_id)
        return lease[0] if lease is not None and time.monotonic() < lease[1] else None

    def lease_renew(self, task_id: str, stamp: TaskStamp, sent_at: float) -> None:
        """The task's stamp as read by a statement sent at `sent_at` (time.monotonic(), taken before
        sending it). A later read's lease is never replaced by an earlier one's."""
        until = sent_at + self.window_s
        with self._lock:
            lease = self._leases.get(task_id)
            if lease is None or lease[1] < until:
                self._leases[task_id] = (stamp, until)

    def renewal_due(self, task_id: str) -> bool:
        """The task's lease is past half its window and no renewal is under way: the caller
        renews it now (and says so with `renewal_done`), so that a steady flow of hits never meets
        a lapsed lease."""
        lease = self._leases.get(task_id)
        if lease is None or lease[1] - time.monotonic() > self.window_s / 2:
            return False
        with self._lock:
            if task_id in self._renewing:
                return False
            self._renewing.add(task_id)
            return True

    def renewal_done(self, task_id: str) -> None:
        self._renewing.discard(task_id)

    def lease_drop(self, task_id: str) -> None:
        self._leases.pop(task_id, None)

    def waiting(self, key: tuple[str, str, str]) -> bool:
        """An entry is kept under `key` (for some stamp)."""
        return key in self._entries

    def get(self, key: tuple[str, str, str], stamp: TaskStamp) -> CachedHit | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] != stamp:
                return None
            self._entries.move_to_end(key)
            return entry[1]

    def put(self, key: tuple[str, str, str], stamp: TaskStamp, hit: CachedHit) -> None:
        size = len(hit.result_json)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old[1].result_json)
            self._entries[key] = (stamp, hit)
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= len(evicted.result_json)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._leases.clear()
            self._bytes = 0


_cache: HitCache | None = None


def hit_cache() -> HitCache:
    """The process's cache, made from the settings on first use (`hit_cache_reset` after changing them)."""
    global _cache
    if _cache is None:
        tvcache = settings.TVCACHE
        _cache = HitCache(
            entries=tvcache["HIT_CACHE_ENTRIES"],
            max_bytes=tvcache["HIT_CACHE_MB"] * 1024 * 1024,
            window_s=tvcache["HIT_CACHE_WINDOW_MS"] / 1000,
        )
    return _cache


def hit_cache_reset() -> None:
    global _cache
    _cache = None


def version_move_wait_s() -> float:
    """How long a change that moves a task's version waits after its commit before it answers:
    W, plus 1 % and 1 ms for processes of other hosts, whose clocks may run at rates a little apart
    (NTP slews a clock by at most 0.05 %); none if the hit cache is off (every process of a
    deployment has the same settings)."""
    cache = hit_cache()
    return cache.window_s * 1.01 + 0.001 if cache.enabled else 0.0
