"""Single flight: rollouts of a task run in parallel and start alike, so they often miss on the
same call in the same state at the same moment. Only one of them executes it; the others wait for
its result and are answered from the cache (tool-server mode, the verl-tool proxy).

A flight is a session advisory lock on (task, anchor state, call digest): a leader whose
connection dies frees it. A leader that fails or times out records nothing, and the next waiter
leads."""

from __future__ import annotations

import hashlib
import time
from contextlib import contextmanager

from django.conf import settings
from django.db import connection

from cache.inputs import CallContext

from .lookup import LookupHit, LookupMiss, tcg_lookup
from .snapshots import lease_release
from .tasks import TaskHandle


class Flight:
    """A miss's claim on executing (task, state, call): held by one rollout at a time. `key` is
    None when there is nothing to coordinate (a hit, a call that is not cacheable, a node that
    exists but is not served: its call is executed by every rollout anyway)."""

    def __init__(self, key: int | None, answer):
        self.key, self.answer, self.waited = key, answer, False

    @classmethod
    def for_answer(cls, *, task: TaskHandle, context: CallContext, answer) -> "Flight":
        key = None
        if isinstance(answer, LookupMiss) and task.policy.for_tool(context.call.tool).cacheable and not answer.seen:
            digest = hashlib.sha256(f"{task.task_id}\0{answer.anchor_key}\0{answer.call_digest}".encode()).digest()
            key = int.from_bytes(digest[:8], "big", signed=True)
        return cls(key, answer)

    def try_lead(self) -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", [self.key])
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
                cursor.execute("SELECT pg_advisory_unlock(%s)", [self.key])
            self.key = None


@contextmanager
def single_flight(*, task: TaskHandle, context: CallContext, answer, resume: bool, timings: dict[str, float]):
    """Lead the execution of a miss, or wait while another rollout executes the same call in the
    same state and take its result (`flight.answer` is then a hit). The time spent waiting goes
    to `timings["wait"]`."""
    flight = Flight.for_answer(task=task, context=context, answer=answer)
    if flight.key is not None:
        waited = time.perf_counter()
        if flight.wait_to_lead() and flight.waited:  # the leader is done: its result, if it recorded one
            if isinstance(answer, LookupMiss) and answer.lease_id:
                lease_release(lease_id=answer.lease_id)
            flight.answer = tcg_lookup(task_id=task.task_id, context=context, count=False, resume=resume)
            if isinstance(flight.answer, LookupHit):
                flight.release()
        if flight.waited:
            timings["wait"] = (time.perf_counter() - waited) * 1000
    try:
        yield flight
    finally:
        flight.release()
