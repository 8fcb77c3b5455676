"""How a request's work gives its thread back to the ASGI front door (cache/api/frontdoor.py).

The front door answers hot requests on lanes: a few threads each, with bounded queues. A thread of
a fast lane must never run a tool for minutes, nor sleep while another request executes what this
one waits for: either would hold up every hit queued behind it. Work that finds it would do either
raises a `HandBack` instead, having undone what it started (claims, leases), and the front door
sends the request on: to the slow lane (`SlowWork`), or after a wait on the event loop, which
holds no thread, for a single-flight claim to be freed (`ClaimAwaited`). The work runs again from the
start; what it does before handing back must be safe to repeat.

Work only hands back when the front door said it may (`lane_current()` is not None): under
Django's own handler it waits or runs where it is.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


class HandBack(Exception):
    """The request's work stopped before doing anything that must not run twice."""

    db_s = 0.0  # set by the front door: time its database statements took


class SlowWork(HandBack):
    """It needs the slow lane (a tool-server miss executes a tool)."""


class ClaimAwaited(HandBack):
    """It waits until the single-flight claim `key` (task, anchor, call digest) is free or its
    node recorded, at most `wait_s` from the first time it waited; then it runs again either way."""

    def __init__(self, key: tuple[str, str, str], wait_s: float):
        super().__init__(key, wait_s)
        self.key, self.wait_s = key, wait_s


@dataclass(frozen=True, slots=True)
class LaneContext:
    fast: bool  # on a lane that serves hits: work that would run a tool hands back (SlowWork)
    waited_s: float  # time this request already spent waiting for claims, on the event loop
    wait_until: float  # time.monotonic() past which it stops waiting and runs anyway
    rerun: bool = False  # a run after a hand-back: the request was admitted (counted) already


_local = threading.local()


def lane_current() -> LaneContext | None:
    return getattr(_local, "context", None)


def lane_set(context: LaneContext | None) -> None:
    """Called by the front door around each run of a request's work (None after it)."""
    _local.context = context


def on_fast_lane() -> bool:
    lane = lane_current()
    return lane is not None and lane.fast


def slow_lane_needed() -> None:
    """Called before work that runs a tool: on a lane that serves hits it hands the request on to
    the slow lane (the caller has undone what it started)."""
    if on_fast_lane():
        raise SlowWork()
