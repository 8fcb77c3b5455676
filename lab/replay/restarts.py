"""The fault arm's service restart: once per cached arm, in its restart epoch, the service is
killed and started again while the rollouts are in flight, and requests it did not answer are
sent again (faults.py)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from tvclient import TVCacheClient
from tvclient.errors import TVCacheError, TVCacheUnavailable

from .arms import Arm
from .faults import FaultPlan

log = logging.getLogger("tvcache.replay")

# Under faults: how long a rollout keeps sending a request the service did not answer (a restart).
RETRY_WINDOW_S = 120.0


def send(request: Callable[[], Any], *, again: bool) -> tuple[Any, int, str | None, float]:
    """(answer, times sent again, None, when last sent: the oracle orders calls by it), or
    (None, times sent again, the last error, when last sent) when the service gave no answer
    within RETRY_WINDOW_S. Only with `again` (under faults) is a request sent again, while the
    service is unreachable or down (TVCacheUnavailable: a restart, a sandbox that died) or still
    holds the rollout for a request that a restart cut off."""
    sent = time.perf_counter()
    if not again:
        return request(), 0, None, sent
    retries, deadline = 0, time.monotonic() + RETRY_WINDOW_S
    while True:
        try:
            return request(), retries, None, sent
        except TVCacheError as exc:
            if not (isinstance(exc, TVCacheUnavailable) or exc.code == "rollout_busy"):
                raise
            if time.monotonic() > deadline:
                return None, retries, f"{type(exc).__name__}: {exc}", sent
        retries += 1
        time.sleep(0.2)
        sent = time.perf_counter()


class ServiceRestart:
    """Restarts the service once per cached arm, after a planned number of the restart epoch's
    calls (FaultPlan.restart_point); `restarts` has an entry per restart."""

    def __init__(
        self, client: TVCacheClient, faults: FaultPlan | None, epochs: int, restart_service: Callable[[], None] | None
    ):
        self.client = client
        self.faults = faults
        self.epochs = epochs
        self.restart_service = restart_service
        self.restarts: list[dict[str, Any]] = []
        self._calls_done = 0
        self._lock = threading.Lock()

    def call_done(self) -> None:
        with self._lock:
            self._calls_done += 1

    @contextlib.contextmanager
    def during(self, arm: Arm, epoch: int, calls: int) -> Iterator[None]:
        """Around an epoch of an arm that makes `calls` calls: its restart, if this is its restart
        epoch, and the requests the restart cut off that tvclient sent again itself."""
        self._calls_done = 0
        finished = threading.Event()
        restart = self._thread(arm, epoch, calls, finished)
        retried_before = self.client.availability.retried
        try:
            yield
        finally:
            finished.set()
            if restart is not None:
                restart.join()
                for entry in self.restarts:
                    if entry["arm"] == arm.name and entry["epoch"] == epoch:
                        entry["client_retried_requests"] = self.client.availability.retried - retried_before

    def _thread(self, arm: Arm, epoch: int, calls: int, finished: threading.Event) -> threading.Thread | None:
        """Under faults, in the arm's restart epoch: a thread that restarts the service once the
        rollouts have made the planned number of calls (they are in flight meanwhile), unless
        the epoch is over first."""
        if self.faults is None or arm.mode == "nocache" or self.restart_service is None:
            return None
        point = self.faults.restart_point(arm.name, self.epochs, calls)
        if point is None or point[0] != epoch:
            return None
        after_calls = point[1]

        def restart() -> None:
            while self._calls_done < after_calls:
                if finished.wait(0.005):
                    return
            started = time.perf_counter()
            entry: dict[str, Any] = {"arm": arm.name, "epoch": epoch, "after_calls": self._calls_done}
            try:
                self.restart_service()
            except Exception as exc:  # reported; the rollouts then fail their retries and say so
                log.exception("restarting the service failed")
                entry["error"] = repr(exc)
            entry["down_s"] = round(time.perf_counter() - started, 3)
            self.restarts.append(entry)

        thread = threading.Thread(target=restart, name=f"replay-restart-{arm.name}", daemon=True)
        thread.start()
        return thread
