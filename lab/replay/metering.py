"""Metering of the client and no-cache arms: time spent in lookups and inside local sandboxes, on
the rollout's own thread, and the sandboxes started, snapshotted and resumed."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from tvclient import ToolExecutionEnvironment, TVCacheClient

from .faults import faulty_answer
from .workload import Call


class Meter(threading.local):
    env_ms = 0.0
    lookup_ms = 0.0
    lookup_server_ms: float | None = 0.0
    # Under faults: (kind, call) an environment fault waits for on this rollout's thread, and
    # whether it fired (the rollout's environment ran that call).
    armed: tuple[str, Call] | None = None
    fired = False


meter = Meter()  # the calling thread's: a rollout runs on one thread


class TimedClient(TVCacheClient):
    """Adds the time of each lookup, and the service's share of it, to the calling thread's
    meter (client mode)."""

    def lookup(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            result = super().lookup(*args, **kwargs)
        finally:
            meter.lookup_ms += (time.perf_counter() - started) * 1000
        # None as soon as one lookup of the call went without the service's figure.
        if meter.lookup_server_ms is not None:
            meter.lookup_server_ms = None if result.server_ms is None else meter.lookup_server_ms + result.server_ms
        return result


class SandboxCounts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def add(self, key: str, n: float = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self.counts = dict(self.counts), Counter()
        return out


class MeteredEnvironment(ToolExecutionEnvironment):
    """Wraps a workload's environment: adds the time spent in it to the calling thread's meter
    and counts starts, snapshots (forks of an env that ran calls) and resume forks."""

    def __init__(self, inner: ToolExecutionEnvironment, counts: SandboxCounts, *, ran: bool = False):
        self.inner = inner
        self.counts = counts
        self.backend = inner.backend
        self._ran = ran

    def _timed(self, fn, *args):
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            meter.env_ms += (time.perf_counter() - started) * 1000

    def start(self) -> None:
        self.counts.add("starts")
        self._timed(self.inner.start)

    def execute(self, call: Call) -> dict[str, Any]:
        self._ran = True
        return self._faulted(call, self._timed(self.inner.execute, call))

    def execute_observed(self, call: Call) -> tuple[dict[str, Any], bool | None]:
        self._ran = True
        result, observed = self._timed(self.inner.execute_observed, call)
        return self._faulted(call, result), observed

    @staticmethod
    def _faulted(call: Call, result: dict[str, Any]) -> dict[str, Any]:
        """The call ran; an environment fault armed for it on this thread answers (or raises) now."""
        armed = meter.armed
        if armed is None or armed[1] != call:
            return result
        meter.armed, meter.fired = None, True
        return faulty_answer(armed[0], result)

    def file_times(self) -> Mapping[str, int] | None:
        return self._timed(self.inner.file_times)

    def restore_file_times(self, times: Mapping[str, int]) -> None:
        self._timed(self.inner.restore_file_times, times)

    def fork(self) -> MeteredEnvironment:
        twin = self._timed(self.inner.fork)
        if self._ran:  # the executor freezing a snapshot of a rollout's env
            self.counts.add("snapshots")
            self.counts.add("snapshot_bytes", getattr(twin, "size_bytes", 0) or 0)
        else:  # a rollout resuming from a frozen snapshot
            self.counts.add("resume_forks")
        return MeteredEnvironment(twin, self.counts)

    def stop(self) -> None:
        self._timed(self.inner.stop)

    def mutates_state(self, call: Call) -> bool:
        return self.inner.mutates_state(call)
