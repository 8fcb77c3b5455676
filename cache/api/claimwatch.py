"""Waiting for single-flight claims on the event loop, without a thread per waiter.

A tool-server rollout that misses on a call another rollout is executing in the same state waits
for that rollout's claim (cache/services/flight.py). Under the ASGI front door it gives its lane
thread back and awaits `ClaimWatch.released(key)`; one thread per process polls the claims of
every awaited key and wakes the waiters whose claim is free, lapsed, or whose node is recorded.
The leader may run in another process: only the database knows, hence the poll."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from django.db import DEFAULT_DB_ALIAS, connections

log = logging.getLogger("tvcache.api")

# Of the awaited keys, those still held: claimed, not lapsed, and no node recorded under them.
HELD_SQL = """
SELECT c.task_id, c.anchor_key, c.call_digest
FROM unnest(%s::varchar[], %s::varchar[], %s::varchar[]) AS k(task_id, anchor_key, call_digest)
JOIN cache_claim c USING (task_id, anchor_key, call_digest)
WHERE c.expires_at > clock_timestamp()
  AND NOT EXISTS (SELECT FROM cache_node n WHERE n.task_id = c.task_id AND n.anchor_key = decode(c.anchor_key, 'hex')
                                              AND n.call_digest = decode(c.call_digest, 'hex'))
"""
POLL_FIRST_S = 0.005  # after a new waiter: a short call's result is taken about as soon as it exists
# Backing off to this while nothing new waits (a slow tool's waiters): one statement per process
# for all its waiters, and a waiter takes a result at most this late (at 0.1 s, the terminal
# replay's first epoch, where rollouts start alike, waited about 50 ms longer per such hit).
POLL_MAX_S = 0.02
RETRY_S = 0.1  # after the database failed to answer

Key = tuple[str, str, str]


class ClaimWatch:
    def __init__(self) -> None:
        self._waiters: dict[Key, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def waiting(self) -> int:
        with self._changed:
            return sum(map(len, self._waiters.values()))

    async def released(self, key: Key, timeout_s: float) -> bool:
        """Until the claim `key` is free or its node recorded (True), or `timeout_s` passed (False)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        entry = (loop, future)
        with self._changed:
            self._waiters.setdefault(key, []).append(entry)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._watch, name="tvcache-claims", daemon=True)
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
            free = keys - self._held(keys)
            with self._changed:
                for key in free:
                    for loop, future in self._waiters.pop(key, []):
                        loop.call_soon_threadsafe(_resolve, future)
                if self._changed.wait(delay):  # a new waiter: poll again soon
                    delay = POLL_FIRST_S
                else:
                    delay = min(delay * 2, POLL_MAX_S)

    @staticmethod
    def _held(keys: set[Key]) -> set[Key]:
        """The awaited claims still held; none when the database cannot be asked (their waiters
        run again and meet the same trouble, answered 503)."""
        db = connections[DEFAULT_DB_ALIAS]
        try:
            with db.cursor() as cursor:
                cursor.execute(HELD_SQL, [list(column) for column in zip(*keys)])
                return set(cursor.fetchall())
        except Exception as exc:
            log.warning("cannot read single-flight claims (%s): their waiters run again", exc)
            db.close()
            time.sleep(RETRY_S)
            return set()


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
