"""How a request's work gives its thread back to the ASGI front door (cache/api/frontdoor.py).

The front door answers hot requests on lanes: a few threads each, with bounded queues. A thread of
a fast lane must never run a tool for minutes, nor sleep while another request executes what this
one waits for: either would hold up every hit queued behind it. Work that finds it would do either
returns a `HandBack` instead of its answer, decided before it started anything that must not run
twice (the rollout protocol decides it: cache/tcg/rollout.py), and the front door sends the
request on: to the slow lane (`SlowWork`), or after a wait on the event loop, which holds no
thread, for a single-flight claim to be freed (`ClaimAwaited`). The work then runs again from the
start: what it did before handing back (a rollout's claim, a lookup) is undone or safe to repeat.

Work only hands back when the front door said it may (`lane_current()` is not None): under
Django's own handler it waits or runs where it is.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


class HandBack:
    """The request's work stopped before doing anything that must not run twice: returned in
    place of its answer."""

    db_s = 0.0  # set by the front door: time its database statements took


class SlowWork(HandBack):
    """It needs the slow lane (a tool-server miss executes a tool)."""


class ClaimAwaited(HandBack):
    """It waits until the single-flight claim `key` (task, anchor, call digest) is free or its
    node recorded, at most `wait_s` from the first time it waited; then it runs again either way."""

    def __init__(self, key: tuple[str, str, str], wait_s: float):
        self.key, self.wait_s = key, wait_s


@dataclass(frozen=True, slots=True)
class LaneContext:
    fast: bool  # on a lane that serves hits: work that would run a tool hands back (SlowWork)
    waited_s: float  # time this request already spent waiting for claims, on the event loop
    wait_until: float  # time.monotonic() past which it stops waiting and runs anyway
    rerun: bool = False  # a run after a hand-back: the request was admitted (counted) already
    arrived: float = 0.0  # time.perf_counter() when the front door took the request (0: unknown)

    def may_wait(self) -> bool:
        """It may still hand the request back to wait for a claim (else it runs alongside)."""
        return self.wait_until is None or time.monotonic() < self.wait_until


_local = threading.local()


def lane_current() -> LaneContext | None:
    return getattr(_local, "context", None)


def lane_set(context: LaneContext | None) -> None:
    """Called by the front door around each run of a request's work (None after it)."""
    _local.context = context
