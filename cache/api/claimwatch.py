"""Waiting for PostgreSQL advisory locks on the event loop, without a thread per waiter.

A tool-server rollout that misses on a call another rollout is executing in the same state waits
for that rollout's single-flight lock (sandboxes/services/toolserver.py). Under the ASGI front
door it gives its lane thread back and awaits `AdvisoryLockWatch.released(key)`; one thread per
process polls pg_locks for every awaited key and wakes the waiters whose lock is free. The leader
may run in another process: only the database knows, hence the poll (a leader whose connection
dies frees its lock without telling anyone)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from django.db import DEFAULT_DB_ALIAS, connections

log = logging.getLogger("tvcache.api")

# Advisory locks taken with one bigint key show its halves in classid and objid (objsubid 1).
HELD_SQL = """
SELECT classid::int8 << 32 | objid::int8 FROM pg_locks
WHERE locktype = 'advisory' AND objsubid = 1 AND granted
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""
POLL_FIRST_S = 0.005  # after a new waiter: a short call's result is taken about as soon as it exists
POLL_MAX_S = 0.1  # backing off to this while nothing new waits (a slow tool's waiters)


class AdvisoryLockWatch:
    def __init__(self) -> None:
        self._waiters: dict[int, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def waiting(self) -> int:
        with self._changed:
            return sum(map(len, self._waiters.values()))

    async def released(self, key: int, timeout_s: float) -> bool:
        """Until no session holds the lock `key` (True) or `timeout_s` passed (False)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        entry = (loop, future)
        with self._changed:
            self._waiters.setdefault(key, []).append(entry)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._watch, name="tvcache-locks", daemon=True)
                self._thread.start()
            self._changed.notify()
        try:
            await asyncio.wait_for(future, timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            with self._changed:
                entries = self._waiters.get(key, [])
                if entry in entries:
                    entries.remove(entry)
                    if not entries:
                        del self._waiters[key]

    def _watch(self) -> None:
        delay = POLL_FIRST_S
        while True:
            with self._changed:
                while not self._waiters:
                    connections[DEFAULT_DB_ALIAS].close()  # idle: give its connection back
                    self._changed.wait()
                    delay = POLL_FIRST_S
                keys = set(self._waiters)
            free = keys - self._held()
            with self._changed:
                for key in free:
                    for loop, future in self._waiters.pop(key, []):
                        loop.call_soon_threadsafe(_resolve, future)
                if self._changed.wait(delay):  # a new waiter: poll again soon
                    delay = POLL_FIRST_S
                else:
                    delay = min(delay * 2, POLL_MAX_S)

    @staticmethod
    def _held() -> set[int]:
        """The advisory locks held in this database; none when it cannot be asked (its waiters run
        again and meet the same trouble, answered 503)."""
        db = connections[DEFAULT_DB_ALIAS]
        try:
            with db.cursor() as cursor:
                cursor.execute(HELD_SQL)
                return {key for (key,) in cursor.fetchall()}
        except Exception as exc:
            log.warning("cannot read advisory locks (%s): their waiters run again", exc)
            db.close()
            time.sleep(POLL_MAX_S)
            return set()


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
