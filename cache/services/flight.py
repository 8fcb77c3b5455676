"""Single flight: rollouts of a task run in parallel and start alike, so they often miss on the
same call in the same state at the same moment. Only one of them executes it; the others wait for
its result and are answered from the cache.

One mechanism for every mode: a claim row on (task, anchor state, call digest) with a time to
live (lookup.py CLAIM_INSERT). Client-mode lookups take it in their own statement and the client
looks up again while another rollout holds it; tool-server calls and the verl-tool proxy take it
here and wait in the service. A leader that fails or times out gives it up and the next waiter
leads; one that dies lets it lapse. Under the ASGI front door a waiter holds no thread: it hands
its request back, and the front door runs it again once the claim is free or its node recorded
(cache/lanes.py, cache/api/claimwatch.py); elsewhere it waits here."""

from __future__ import annotations

import time
from contextlib import contextmanager

from django.conf import settings
from django.db import connection

from cache.lanes import ClaimAwaited, SlowWork, lane_current
from cache.tcg.records import CallContext

from .lookup import CLAIM_INSERT, CLAIM_RELEASE_SQL, LookupHit, LookupMiss, tcg_lookup
from .snapshots import lease_release
from .tasks import TaskHandle

# Lead (the claim was taken) or go on (the node exists now: its leader recorded it).
LEAD_SQL = (
    "WITH claimed AS (" + CLAIM_INSERT.format(condition="true") + ") SELECT EXISTS (SELECT FROM claimed)"
    " OR EXISTS (SELECT FROM cache_node n WHERE n.task_id = %(task)s AND n.anchor_key = %(anchor)s"
    " AND n.call_digest = %(digest)s)"
)


class Flight:
    """A miss's claim on executing (task, state, call): held by one rollout at a time. `key` is
    None when there is nothing to coordinate (a hit, a call that is not cacheable, a node that
    exists but is not served: its call is executed by every rollout anyway). A leader that died
    blocks the others for at most CLAIM_TTL_S; a call that runs longer than that may be executed
    alongside it by a waiter (twice, never wrongly)."""

    def __init__(self, key: tuple[str, str, str] | None, answer, holder: str):
        self.key, self.answer, self.waited, self.holder = key, answer, False, holder

    @classmethod
    def for_answer(cls, *, task: TaskHandle, context: CallContext, answer) -> Flight:
        key = None
        if isinstance(answer, LookupMiss) and task.policy.for_tool(context.call.tool).cacheable and not answer.seen:
            key = (task.task_id, answer.anchor_key, answer.call_digest)
        return cls(key, answer, context.rollout_id or "")

    def _params(self) -> dict:
        task, anchor, digest = self.key
        return {
            "task": task,
            "anchor": anchor,
            "digest": digest,
            "holder": self.holder,
            "ttl": settings.TVCACHE["CLAIM_TTL_S"],
        }

    def try_lead(self) -> bool:
        """True if this rollout leads now, or the leader has recorded the call meanwhile."""
        with connection.cursor() as cursor:
            cursor.execute(LEAD_SQL, self._params())
            return cursor.fetchone()[0]

    def wait_to_lead(self) -> bool:
        """Wait while another rollout leads; True once this one leads. A leader stuck for
        SINGLE_FLIGHT_WAIT_S is given up on (False, no key): the call is executed alongside it."""
        deadline, delay = time.monotonic() + settings.TVCACHE["SINGLE_FLIGHT_WAIT_S"], 0.005
        while not self.try_lead():
            self.waited = True
            if time.monotonic() > deadline:
                self.key = None
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        return True

    def release(self) -> None:
        """Called once the result is recorded (or the execution failed): the waiting rollouts
        find it, or lead."""
        if self.key is not None:
            with connection.cursor() as cursor:
                cursor.execute(CLAIM_RELEASE_SQL, self._params())
            self.key = None


@contextmanager
def single_flight(*, task: TaskHandle, context: CallContext, answer, resume: bool, timings: dict[str, float]):
    """Lead the execution of a miss, or wait while another rollout executes the same call in the
    same state and take its result (`flight.answer` is then a hit). The time spent waiting goes
    to `timings["wait"]`. On a front door's lane (cache/lanes.py) a miss hands its request on
    instead: to the slow lane from one that serves hits, and back to the event loop to wait."""
    flight = Flight.for_answer(task=task, context=context, answer=answer)
    lane = lane_current()
    if lane is not None:
        _lane_flight(flight, lane, timings)
    elif flight.key is not None:
        waited = time.perf_counter()
        if flight.wait_to_lead() and flight.waited:  # the leader is done: its result, if it recorded one
            _lease_drop(answer)
            flight.answer = tcg_lookup(task_id=task.task_id, context=context, count=False, resume=resume)
            if isinstance(flight.answer, LookupHit):
                flight.release()
        if flight.waited:
            timings["wait"] = (time.perf_counter() - waited) * 1000
    try:
        yield flight
    finally:
        flight.release()


def _lane_flight(flight: Flight, lane, timings: dict[str, float]) -> None:
    """Lead, or hand the request back (its lease given back first) to wait without a thread."""
    if lane.waited_s:  # this request waited for a leader already
        flight.waited = True
        timings["wait"] = lane.waited_s * 1000
    if isinstance(flight.answer, LookupMiss) and lane.fast:
        _lease_drop(flight.answer)
        raise SlowWork()
    if flight.key is None or flight.try_lead():
        return
    if lane.wait_until is None or time.monotonic() < lane.wait_until:
        _lease_drop(flight.answer)
        raise ClaimAwaited(flight.key, settings.TVCACHE["SINGLE_FLIGHT_WAIT_S"])
    flight.key = None  # a leader stuck this long: execute alongside it


def _lease_drop(answer) -> None:
    if isinstance(answer, LookupMiss) and answer.lease_id:
        lease_release(lease_id=answer.lease_id)
