"""Single flight: rollouts of a task run in parallel and start alike, so they often miss on the
same call in the same state at the same moment. Only one of them executes it; the others wait for
its result and are answered from the cache.

One mechanism for every mode: a claim row on (task, anchor state, call digest) with a time to
live (lookup.py CLAIM_INSERT). Client-mode lookups take it in their own statement and the client
looks up again while another rollout holds it; tool-server calls and the verl-tool proxy take it
here and wait in the service. A leader that fails or times out gives it up and the next waiter
leads; one that dies lets it lapse. When to lead, wait or look up again is the rollout protocol's
(cache/tcg/rollout.py). Under the ASGI front door a waiter holds no thread: it hands its request
back, and the front door runs it again once the claim is free or its node recorded (core/lanes.py,
cache/api/claimwatch.py); elsewhere it waits here (`Flight.wait_to_lead`)."""

from __future__ import annotations

import time

from django.conf import settings
from django.db import connection

from cache.tcg.records import CallContext
from cache.tcg.rollout import Looked

from .lookup import CLAIM_INSERT, CLAIM_RELEASE_SQL, GRANTED, LookupHit, LookupMiss
from .tasks import TaskHandle

# Lead (the claim was taken) or go on (the node exists now: its leader recorded it).
LEAD_SQL = (
    "WITH claimed AS (" + CLAIM_INSERT.format(condition="true") + ") SELECT EXISTS (SELECT FROM claimed)"
    " OR EXISTS (SELECT FROM cache_node n WHERE n.task_id = %(task)s AND n.anchor_key = decode(%(anchor)s, 'hex')"
    " AND n.call_digest = decode(%(digest)s, 'hex'))"
)


class Flight:
    """A miss's claim on executing (task, state, call): held by one rollout at a time. `key` is
    None when there is nothing to coordinate (a hit, a call that is not cacheable, a node that
    exists but is not served: its call is executed by every rollout anyway). A leader that died
    blocks the others for at most CLAIM_TTL_S; a call that runs longer than that may be executed
    alongside it by a waiter (twice, never wrongly)."""

    def __init__(self, key: tuple[str, str, str] | None, answer, holder: str):
        self.key, self.answer, self.holder = key, answer, holder

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
        """True if this rollout leads now, or the leader has recorded the call meanwhile. A lookup
        that asked for the claim in its own statement (tcg_lookup's `claim`) answered already: no
        statement then."""
        claimed = getattr(self.answer, "claim", None)
        if claimed is not None:
            return claimed == GRANTED
        with connection.cursor() as cursor:
            cursor.execute(LEAD_SQL, self._params())
            return cursor.fetchone()[0]

    def wait_to_lead(self) -> bool:
        """Wait while another rollout leads; True once this one leads. A leader stuck for
        SINGLE_FLIGHT_WAIT_S is given up on (False, no key): the call is executed alongside it."""
        deadline, delay = time.monotonic() + settings.TVCACHE["SINGLE_FLIGHT_WAIT_S"], 0.005
        self.answer = None  # each try asks the database again
        while not self.try_lead():
            if time.monotonic() > deadline:
                self.key = None
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        return True

    def release(self, *, recorded: tuple[str, str] | None = None) -> None:
        """Called once the result is recorded (or the execution failed): the waiting rollouts
        find it, or lead. `recorded`: the (anchor, digest) the result was recorded under; when it
        is the claim's, the release would delete nothing (a claim whose node exists stays until it
        lapses: record.py), so no statement is sent."""
        if self.key is not None and recorded is not None and tuple(self.key[1:]) == tuple(recorded):
            self.key = None
        if self.key is not None:
            with connection.cursor() as cursor:
                cursor.execute(CLAIM_RELEASE_SQL, self._params())
            self.key = None


def looked(*, task: TaskHandle, context: CallContext, answer) -> Looked:
    """A lookup's answer as the rollout protocol takes it (cache/tcg/rollout.py)."""
    if isinstance(answer, LookupHit):
        return Looked(hit=True, mutates=answer.mutates)
    return Looked(hit=False, flight_key=Flight.for_answer(task=task, context=context, answer=answer).key)
