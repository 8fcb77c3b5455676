"""Work on a rollout's sandbox after its call was answered (tool-server mode): the snapshot a miss
registers is taken off the rollout's critical path.

The work runs in a thread of the serving process. Until it is done the sandbox stays reserved to
it: the thread holds a session advisory lock keyed on the rollout, on its own database
connection, and holds it before the call's answer leaves (the hand-off); the rollout's next miss,
in whichever process serves it, waits for that lock before it touches the sandbox. Hits need no
sandbox and never wait. A process that dies mid-work drops its connection, and the lock with it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable

from django.db import connection

log = logging.getLogger("tvcache.toolserver")

HANDOFF_S = 5.0  # a thread that does not hold the reservation by then is not waited for
_RESERVED_SQL = "SELECT pg_try_advisory_lock(%s)"
_FREE_SQL = "SELECT CASE WHEN pg_try_advisory_lock(%s) THEN pg_advisory_unlock(%s) ELSE false END"

_threads: set[threading.Thread] = set()
_threads_lock = threading.Lock()


def reservation_key(rollout_pk: int) -> int:
    digest = hashlib.sha256(f"tvcache-reserved\0{rollout_pk}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class _Handoff:
    """The thread takes the reservation, or the caller gives up on it: whichever comes first."""

    def __init__(self):
        self._lock = threading.Lock()
        self._decided = threading.Event()
        self.state = "pending"  # -> "held" (the thread runs the work) | "abandoned" | "refused"

    def decide(self, state: str) -> str:
        with self._lock:
            if self.state == "pending":
                self.state = state
                self._decided.set()
            return self.state

    def wait(self, timeout_s: float) -> str:
        self._decided.wait(timeout_s)
        return self.decide("abandoned")


def run_reserved(rollout_pk: int, work: Callable[[], None], *, name: str) -> bool:
    """Runs `work` in a thread that reserves the rollout's sandbox while it runs. Returns once the
    thread holds the reservation (True), or False when it could not take it in HANDOFF_S or found
    it held: then `work` does not run there, and the caller decides."""
    handoff = _Handoff()
    thread = threading.Thread(target=_reserved, args=(rollout_pk, work, handoff), name=f"tvcache-{name}", daemon=True)
    with _threads_lock:
        _threads.add(thread)
    thread.start()
    return handoff.wait(HANDOFF_S) == "held"


def _reserved(rollout_pk: int, work: Callable[[], None], handoff: _Handoff) -> None:
    key = reservation_key(rollout_pk)
    try:
        with connection.cursor() as cursor:
            cursor.execute(_RESERVED_SQL, [key])
            held = cursor.fetchone()[0]
        if handoff.decide("held" if held else "refused") != "held":
            if held:
                _release(key)
            return
        try:
            work()
        except Exception:  # noqa: BLE001 - the rollout already has its answer; the work only adds reuse
            log.exception("background work on rollout %s failed", rollout_pk)
        finally:
            _release(key)
    except Exception:  # noqa: BLE001 - no database: the caller gave up on the hand-off, or will
        handoff.decide("refused")
        log.exception("background work on rollout %s could not reserve its sandbox", rollout_pk)
    finally:
        connection.close()
        with _threads_lock:
            _threads.discard(threading.current_thread())


def _release(key: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_unlock(%s)", [key])


def wait_unreserved(rollout_pk: int, *, timeout_s: float) -> float | None:
    """Waits while background work holds the rollout's sandbox; returns the ms it waited, None if
    it was free at once. Past `timeout_s` it stops waiting (work stuck that long is given up on:
    it never moves the sandbox's state)."""
    key = reservation_key(rollout_pk)
    started = time.perf_counter()
    deadline, delay = time.monotonic() + timeout_s, 0.002
    while True:
        with connection.cursor() as cursor:
            cursor.execute(_FREE_SQL, [key, key])
            if cursor.fetchone()[0]:
                return (time.perf_counter() - started) * 1000 if delay > 0.002 else None
        if time.monotonic() > deadline:
            log.warning("rollout %s: background work still holds its sandbox after %.0f s", rollout_pk, timeout_s)
            return (time.perf_counter() - started) * 1000
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def settle(timeout_s: float = 120.0) -> bool:
    """Waits for this process's background work to end (tests, shutdown); False on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _threads_lock:
            threads = list(_threads)
        if not threads:
            return True
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if time.monotonic() > deadline:
            return False

