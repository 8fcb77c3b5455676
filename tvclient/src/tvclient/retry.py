"""Retries with backoff and jitter, and what a client believes of the service's availability.

A request that finds the service unreachable, answering 5xx or shedding load (429 or 503, with
`Retry-After` honoured) is tried again with exponential backoff and full jitter, within a
bounded time. One that used its whole budget marks the service down: then a request makes a
single attempt at most every `probe_s` and the others fail at once (so that every rollout
started during an outage does not wait out a budget of its own); a probe's success clears the
mark.
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
    probe_s: float = 1.0  # while marked down: one request a single attempt this often, others fail at once

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
        self._down = False
        self._next_probe = 0.0
        self.retried = 0  # requests sent again at least once (the service failed them first)
        self.given_up = 0  # requests that spent their budget (or probe) without an answer

    def attempt(self) -> Attempt:
        """A request's attempts: within the budget while the service is up, a single one when it
        is the probe; raises TVCacheUnavailable at once while the service is marked down."""
        now = time.monotonic()
        with self._lock:
            if not self._down:
                return Attempt(self, now + self.policy.budget_s)
            if now < self._next_probe:
                raise TVCacheUnavailable(None, "unavailable", "the service is marked down after a failed request")
            self._next_probe = now + self.policy.probe_s
        return Attempt(self, now)

    def succeeded(self) -> None:
        with self._lock:
            self._down = False

    def gave_up(self) -> None:
        with self._lock:
            self._down, self._next_probe = True, time.monotonic() + self.policy.probe_s
            self.given_up += 1

    def note_retry(self) -> None:
        with self._lock:
            self.retried += 1


class Attempt:
    """One request's retries: `wait(error)` says how long to sleep before the next attempt, or
    None when the budget is spent (the service is then marked down)."""

    def __init__(self, availability: Availability, deadline: float) -> None:
        self._availability = availability
        self._deadline = deadline
        self._cap = availability.policy.first_s
        self._retried = False

    def wait(self, error: TVCacheUnavailable) -> float | None:
        policy = self._availability.policy
        delay = random.uniform(0.0, self._cap)
        if error.retry_after_s is not None:
            delay = max(delay, error.retry_after_s)
        self._cap = min(self._cap * 2, policy.max_s)
        if time.monotonic() + delay > self._deadline:
            self._availability.gave_up()
            return None
        if not self._retried:
            self._retried = True
            self._availability.note_retry()
        return delay
