"""Sandbox-seconds.

- Local sandboxes (nocache, client mode): each one's lifetime, from its start (a fork's: its first
  use, when its container starts) to its stop, summed. A frozen snapshot that no rollout resumed is
  an image, not a sandbox, and counts nothing.
- The service's sandboxes (tool-server mode): the API does not give their lifetimes, so the
  tasks' live sandboxes (GET .../sandboxes: warming, ready in a pool, leased, stopping) are listed
  every SAMPLE_S and their number integrated over the arm's epoch; pools warmed for the step count.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from ..metering import MeteredEnvironment, SandboxCounts, TimedClient
from ..workload import Call

SAMPLE_S = 0.25


class CallMeter(threading.local):
    """On the rollout's thread, during one call: local sandboxes opened, executions run."""

    opened = 0
    executed = 0


call_meter = CallMeter()


class Lifetimes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds = 0.0
        self.sandboxes = 0

    def add(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds
            self.sandboxes += 1

    def take(self) -> tuple[float, int]:
        with self._lock:
            out, self.seconds, self.sandboxes = (self.seconds, self.sandboxes), 0.0, 0
        return out


class LiveEnvironment(MeteredEnvironment):
    """A MeteredEnvironment whose lifetime is added to `lifetimes` when it stops."""

    def __init__(self, inner, counts: SandboxCounts, lifetimes: Lifetimes, *, ran: bool = False):
        super().__init__(inner, counts, ran=ran)
        self.lifetimes = lifetimes
        self._since: float | None = None

    def _live(self) -> None:
        if self._since is None:
            self._since = time.perf_counter()
            call_meter.opened += 1

    def start(self) -> None:
        self._live()
        super().start()

    def execute(self, call: Call) -> dict[str, Any]:
        self._live()
        call_meter.executed += 1
        return super().execute(call)

    def execute_observed(self, call: Call) -> tuple[dict[str, Any], bool | None]:
        self._live()
        call_meter.executed += 1
        return super().execute_observed(call)

    def restore_file_times(self, times) -> None:
        self._live()
        super().restore_file_times(times)

    def fork(self) -> LiveEnvironment:
        twin = super().fork()
        return LiveEnvironment(twin.inner, self.counts, self.lifetimes)

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            if self._since is not None:
                self.lifetimes.add(time.perf_counter() - self._since)
                self._since = None


class LiveSandboxes:
    """Sandbox-seconds of the service's sandboxes of some tasks, sampled (module docstring), and
    their split by state and pool (`by_state`: "leased/fork", "ready/root", ...)."""

    def __init__(self, client: TimedClient, task_ids: list[str]):
        self.client = client
        self.task_ids = task_ids
        self.seconds = 0.0
        self.by_state: dict[str, float] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="tree-live-sandboxes", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        self.by_state = {key: round(s, 3) for key, s in sorted(self.by_state.items())}
        return self.seconds

    def _live(self) -> Counter[str]:
        return Counter(
            f"{sandbox['state']}/{sandbox['pool']}"
            for task_id in self.task_ids
            for sandbox in self.client.sandboxes(task_id)["live"]
        )

    def _add(self, live: Counter[str], seconds: float) -> None:
        for key, n in live.items():
            self.by_state[key] = self.by_state.get(key, 0.0) + n * seconds
            self.seconds += n * seconds

    def _sample(self) -> None:
        live, at = self._live(), time.perf_counter()
        while not self._done.wait(SAMPLE_S):
            now_live, now = self._live(), time.perf_counter()
            self._add(live, now - at)
            live, at = now_live, now
        self._add(live, time.perf_counter() - at)
