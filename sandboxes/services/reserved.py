"""Work on a rollout's sandbox after its call was answered (tool-server mode): the snapshot a miss
registers is taken off the rollout's critical path.

The work runs in a thread of the serving process. Until it ends the sandbox stays reserved to it:
a session advisory lock keyed on the rollout, taken before the call's answer leaves and released
when the work ends. The rollout's next miss, in whichever process serves it, waits for that lock
before it touches the sandbox (`wait_unreserved`); hits need no sandbox and never wait.

The locks of a process are held on one connection of their own (`_Holder`, outside the pool: a
commit can take seconds, and the tool-server threads need the pool), so a hand-off costs one
statement, and a process that dies drops its connection and its reservations with it (its
threads died too: nothing of theirs touches the sandbox any more).

A snapshot's work also holds a lock keyed on its node (`snapshot_key`) until it is registered (or
failed): a rollout about to replay the calls up to that node, more than restoring the snapshot
would cost, waits for it instead (`snapshot_pending`, `wait_snapshot`).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from django.db import connection, connections
from django.db.utils import load_backend

log = logging.getLogger("tvcache.toolserver")

# Whether a reservation's key is free (taken and given back at once), in any statement: its key twice.
FREE = "CASE WHEN pg_try_advisory_lock(%s) THEN pg_advisory_unlock(%s) ELSE false END"
_FREE_SQL = f"SELECT {FREE}"
_HOLDER_IDLE_S = 30.0  # the holder's connection closes after this long without a reservation
_STATEMENT_S = 10.0  # a hand-off or release the holder has not done by then is given up

_threads: set[threading.Thread] = set()
_threads_lock = threading.Lock()


def reservation_key(rollout_pk: int) -> int:
    """A key of the one-bigint advisory lock space, apart from the rollout claims' (their keys are
    the rollouts' ids: small positive numbers)."""
    return _key(f"tvcache-reserved\0{rollout_pk}")


def snapshot_key(node_id: int) -> int:
    """The key held while a snapshot of the node's state is being taken."""
    return _key(f"tvcache-snapshot\0{node_id}")


def _key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True) | (1 << 62)


class _Holder:
    """One thread and one database connection per process that take and release reservations."""

    def __init__(self):
        self._requests: queue.Queue[tuple[str, int, Future]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.held: set[int] = set()

    def ask(self, action: str, key: int = 0) -> bool:
        """`take` (False: held already, or no database), `release`, or `close` (if none is held)."""
        answer: Future[bool] = Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="tvcache-reservations", daemon=True)
                self._thread.start()
            self._requests.put((action, key, answer))
        try:
            return answer.result(_STATEMENT_S)
        except Exception:  # noqa: BLE001 - a holder that does not answer reserves nothing
            log.exception("reservation %s of %s failed", action, key)
            if action == "take":  # it may be taken late: give it back then
                self._requests.put(("release", key, Future()))
            return False

    def _serve(self) -> None:
        wrapper = None
        while True:
            try:
                action, key, answer = self._requests.get(timeout=_HOLDER_IDLE_S)
            except queue.Empty:
                action, key, answer = "close", 0, Future()
            try:
                if action == "close":
                    if not self.held and wrapper is not None:
                        wrapper.close()
                        wrapper = None
                    answer.set_result(not self.held)
                    continue
                wrapper = wrapper or _own_connection()
                answer.set_result(self._do(wrapper, action, key))
            except Exception as exc:  # noqa: BLE001 - the connection broke, and its locks with it
                log.exception("reservations: %s of %s failed", action, key)
                self.held.clear()
                if wrapper is not None:
                    try:
                        wrapper.close()
                    except Exception:  # noqa: BLE001
                        pass
                wrapper = None
                if not answer.done():
                    answer.set_exception(exc)

    def _do(self, wrapper, action: str, key: int) -> bool:
        with wrapper.cursor() as cursor:
            if action == "take":
                if key in self.held:  # locks are reentrant on one connection: never take one twice
                    return False
                cursor.execute("SELECT pg_try_advisory_lock(%s)", [key])
                taken = bool(cursor.fetchone()[0])
                if taken:
                    self.held.add(key)
                return taken
            if key not in self.held:
                return False
            self.held.discard(key)
            cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
            return bool(cursor.fetchone()[0])


def _own_connection():
    """A connection to the default database outside its pool, for the holder's thread."""
    settings = dict(connections.settings["default"])
    settings["OPTIONS"] = {k: v for k, v in settings.get("OPTIONS", {}).items() if k != "pool"}
    return load_backend(settings["ENGINE"]).DatabaseWrapper(settings, "tvcache-reservations")


_holder = _Holder()


def run_reserved(rollout_pk: int, work: Callable[[], None], *, name: str, snapshot_of: int | None = None) -> bool:
    """Runs `work` in a thread of its own, the rollout's sandbox reserved to it until it ends (and,
    for a snapshot of node `snapshot_of`, its `snapshot_key` held). Returns once the reservation
    is held (True); False when it is held already or the database cannot take it: then `work`
    does not run, and the caller decides."""
    keys = [reservation_key(rollout_pk)]
    if not _holder.ask("take", keys[0]):
        return False
    if snapshot_of is not None and _holder.ask("take", snapshot_key(snapshot_of)):
        keys.append(snapshot_key(snapshot_of))
    thread = threading.Thread(target=_reserved, args=(rollout_pk, keys, work), name=f"tvcache-{name}", daemon=True)
    with _threads_lock:
        _threads.add(thread)
    try:
        thread.start()
    except BaseException:
        with _threads_lock:
            _threads.discard(thread)
        for key in keys:
            _holder.ask("release", key)
        raise
    return True


def _reserved(rollout_pk: int, keys: list[int], work: Callable[[], None]) -> None:
    try:
        work()
    except Exception:  # noqa: BLE001 - the rollout has its answer; the work only adds reuse
        log.exception("background work on rollout %s failed", rollout_pk)
    finally:
        for key in keys:
            _holder.ask("release", key)
        connection.close()  # the work's own connection (the pool's, or the thread's)
        with _threads_lock:
            _threads.discard(threading.current_thread())


def wait_unreserved(rollout_pk: int, *, timeout_s: float) -> float | None:
    """Waits while background work holds the rollout's sandbox. Returns the ms it waited (0.0
    when it was free at once), or None past `timeout_s`: the work is stuck, and the caller must
    not touch the sandbox (it retires it)."""
    waited = _wait_free(reservation_key(rollout_pk), timeout_s)
    if waited is None:
        log.warning("rollout %s: background work still holds its sandbox after %.0f s", rollout_pk, timeout_s)
    return waited


def snapshot_pending(node_id: int) -> bool:
    """A snapshot of the node's state is being taken (by this or another process)."""
    return _wait_free(snapshot_key(node_id), 0.0) is None


def wait_snapshot(node_id: int, *, timeout_s: float) -> float | None:
    """Waits while a snapshot of the node's state is being taken: the ms it waited, None past
    `timeout_s`."""
    return _wait_free(snapshot_key(node_id), timeout_s)


def _wait_free(key: int, timeout_s: float) -> float | None:
    started = time.perf_counter()
    deadline, delay = time.monotonic() + timeout_s, 0.002
    while True:
        with connection.cursor() as cursor:
            cursor.execute(_FREE_SQL, [key, key])
            if cursor.fetchone()[0]:
                return 0.0 if delay == 0.002 else (time.perf_counter() - started) * 1000
        if time.monotonic() >= deadline:
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def settle(timeout_s: float = 120.0) -> bool:
    """Waits for this process's background work to end and closes the reservations' connection
    (tests: before they look at the graph, and before their database is flushed); False on
    timeout. A server that stops without it loses only the snapshots still being taken.

    A hand-off under way in another request (its reservation taken, its thread not started yet,
    or not even listed) is waited for like the threads."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _threads_lock:
            threads = list(_threads)
        if not threads and _holder.ask("close"):
            return True
        starting = not threads
        for thread in threads:
            if thread.ident is None:  # listed before it starts (run_reserved)
                starting = True
            else:
                thread.join(max(0.0, deadline - time.monotonic()))
        if time.monotonic() > deadline:
            return False
        if starting:
            time.sleep(0.01)
