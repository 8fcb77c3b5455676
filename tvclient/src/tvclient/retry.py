"""Retries with backoff and jitter, and what a client believes of the service's availability.

A request that finds the service unreachable, answering 5xx or shedding load (429 or 503, with
`Retry-After` honoured) is tried again with exponential backoff and full jitter, within a
bounded time. One that used its whole budget marks the service down: for `down_s` the client's
requests fail at once (so that every rollout started during an outage does not wait out a budget
of its own), then a single attempt probes whether it is back; its success clears the mark.
The executor turns what still fails into an uncached call (ToolCallExecutor, "outages").
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass

from .errors import TVCacheUnavailable

BUDGET_VARIABLE = "TVCACHE_RETRY_S"


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    budget_s: float = 10.0  # how long one request may keep trying
    first_s: float = 0.05  # the first backoff's cap; doubles up to max_s
    max_s: float = 2.0
    down_s: float = 5.0  # after a request gave up: fail at once this long, then probe once

    @classmethod
    def from_environment(cls) -> RetryPolicy:
        """The default policy, with TVCACHE_RETRY_S as the budget when it is set."""
        budget = os.environ.get(BUDGET_VARIABLE)
        return cls(budget_s=float(budget)) if budget else cls()


class Availability:
    """The service's availability as one client sees it, shared by its threads."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._suspect = False  # gave up before: the next attempt is a single probe

    def attempt(self) -> Attempt:
        """A request's attempts; raises TVCacheUnavailable at once while the service is marked down."""
        now = time.monotonic()
        with self._lock:
            if now < self._down_until:
                raise TVCacheUnavailable(None, "unavailable", "the service is marked down after a failed request")
            probe = self._suspect
        return Attempt(self, now + (0.0 if probe else self.policy.budget_s))

    def succeeded(self) -> None:
        with self._lock:
            self._suspect, self._down_until = False, 0.0

    def gave_up(self) -> None:
        with self._lock:
            self._suspect, self._down_until = True, time.monotonic() + self.policy.down_s


class Attempt:
    """One request's retries: `wait(error)` says how long to sleep before the next attempt, or
    None when the budget is spent (the service is then marked down)."""

    def __init__(self, availability: Availability, deadline: float) -> None:
        self._availability = availability
        self._deadline = deadline
        self._cap = availability.policy.first_s

    def wait(self, error: TVCacheUnavailable) -> float | None:
        policy = self._availability.policy
        delay = random.uniform(0.0, self._cap)
        if error.retry_after_s is not None:
            delay = max(delay, error.retry_after_s)
        self._cap = min(self._cap * 2, policy.max_s)
        if time.monotonic() + delay > self._deadline:
            self._availability.gave_up()
            return None
        return delay
