"""What a process keeps for a few seconds instead of reading it on every request (verified
tokens, snapshot costs, the engine's health), and what it computed lately (`RecentMemo`).

Not cachetools: the token check reads this on every hot-path request from several threads, and
cachetools' caches need a lock around every read; here a read and a write are one dict operation
each (atomic under the GIL), and each entry has a lifetime of its own (a token's ends with the
token's expiry)."""

from __future__ import annotations

import threading
import time
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class TTLCache(Generic[K, V]):
    def __init__(self) -> None:
        self._entries: dict[K, tuple[V, float]] = {}

    def get(self, key: K) -> V | None:
        """The value put under `key`, unless its time is up."""
        entry = self._entries.get(key)
        return entry[0] if entry is not None and entry[1] > time.monotonic() else None

    def put(self, key: K, value: V, ttl_s: float) -> None:
        """Keep `value` for `ttl_s` seconds."""
        self._entries[key] = (value, time.monotonic() + ttl_s)

    def pop(self, key: K) -> None:
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()


class RecentMemo(Generic[K, V]):
    """What a process computed lately, by key: at most `entries` of it, the oldest put out first.
    Shared by the event loop and the lanes' threads: a read is one dict operation (atomic under
    the GIL, no lock); a write takes a lock. Oldest put, not least recently read: what it keeps
    (a rollout's latest history) is read once or twice, soon after it is put."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._memo: dict[K, V] = {}
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        return self._memo.get(key)

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._memo.pop(key, None)  # put again: the newest
            self._memo[key] = value
            while len(self._memo) > self.entries:
                del self._memo[next(iter(self._memo))]
