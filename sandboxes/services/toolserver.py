"""Tool-server mode: the service keeps each rollout's history and runs its misses.

Each call goes through the rollout protocol (cache/tcg/rollout.py), this module doing its I/O:
a call is looked up; a hit needs no sandbox. A miss is led by one rollout at a time (single
flight: the others wait for its result and are answered from the cache, their sandboxes catching
up on their next miss), executed in the rollout's sandbox brought to its history's state
(materialize.py), observed (misses.py), and recorded unless the known-state rule says its
effects are unknown.

A rollout that has a sandbox and hits a state-changing call has its sandbox catch up after the
answer, while the policy thinks (materialize.catch_up_after_answer), so its next miss need not.

The rollout's history holds the calls that changed its state: a hit on a read-only node, or a
miss that the sandbox observed to change nothing (a `cat` in a docker sandbox), is left out, so
the rollout's later calls match those of rollouts that did not make it. A detached rollout's
calls run in its own sandbox as it is, uncached and unrecorded.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson
from django.conf import settings
from django.db.models import Exists, OuterRef
from django.utils import timezone

from accounts.projects import task_public_id
from cache.models import Rollout, Task
from cache.notfound import unknown_task
from cache.selectors import task_for_miss
from cache.services import (
    Flight,
    LookupHit,
    LookupMiss,
    RolloutClaim,
    hit_count,
    kept_digests,
    lease_release,
    looked,
    lookup_count,
    rollout_claim,
    rollout_history_append,
    rollout_unclaim,
    task_handle,
    tcg_lookup,
)
from cache.tcg import ToolCall
from cache.tcg.records import NO_TRACE, CallContext, Trace
from cache.tcg.rollout import Act, Looked, RolloutCall
from core.errors import Conflict, NotFound
from core.lanes import ClaimAwaited, HandBack, SlowWork, lane_current
from sandboxes.backends.base import SandboxError, SandboxGone
from sandboxes.handles import as_application_error, backend_named, env_check_granted, sandbox_handle
from sandboxes.models import Sandbox

from .audit import hit_audit_enqueue
from .materialize import Phases, catch_up_after_answer, own_marked, resume_snapshotted, retire, unmarked
from .misses import miss_detach, miss_execute, miss_record
from .pools import idle_deadline, sandbox_stop

# Read with the rollout's claim: whether the rollout has a sandbox of its own, which it brings up
# to date rather than fork a snapshot (its lookups then lease none).
HAS_SANDBOX = Exists(Sandbox.objects.filter(rollout=OuterRef("pk"), state=Sandbox.State.LEASED))


@dataclass(frozen=True, slots=True)
class CallOutcome:
    result: Any
    cached: bool
    node_id: int | None
    latency_ms: float
    mutates: bool  # the call changed the rollout's state (it is part of the history now)
    phases_ms: dict[str, float] = field(default_factory=dict)  # where the time went (Phases)


def rollout_call(
    *, task_id: str, rollout_id: str, call: ToolCall, epoch: int = 0, trace: Trace = NO_TRACE
) -> CallOutcome | HandBack:
    """The call served by the rollout protocol (cache/tcg/rollout.py), this module doing its I/O.
    Four statements for a hit (claim and read the rollout, the lookup, the history append, the
    release); the task's row and a sandbox only for a miss. On a front door's lane, a request
    that must run a tool or wait for another rollout's claim is handed back (core/lanes.py)."""
    started = time.perf_counter()
    handle = task_handle(task_id=task_id, cached=True)  # outdated at worst: the lookup checks its version
    try:
        backend_named(handle.backend).tool_spec(call.tool)
    except SandboxError as exc:
        raise as_application_error(exc) from None
    claimed = time.perf_counter()
    claim = rollout_claim(task_id=task_id, rollout_id=rollout_id, epoch=epoch, extra=HAS_SANDBOX)
    serving = _Serving(handle, claim, call, epoch, trace)
    serving.phases.ms["claim"] = (time.perf_counter() - claimed) * 1000
    lane = lane_current()
    if lane is not None and lane.arrived:  # the front door's queues, and a run that handed the request on
        serving.phases.ms["lanes"] = max(0.0, (started - lane.arrived - lane.waited_s) * 1000)
    try:
        return serving.drive(claim.detached, started)
    finally:
        serving.close()


class _Serving:
    """One tool-server call driven through the rollout protocol."""

    def __init__(self, handle, claim: RolloutClaim, call: ToolCall, epoch: int, trace: Trace):
        self.handle, self.rollout, self.history, self.call = handle, claim.rollout, claim.history, call
        # A rollout with a sandbox replays what it missed in it: a miss needs no snapshot's lease
        # (if the sandbox is gone by then, the miss starts a fresh one and replays everything).
        self.has_sandbox = bool(claim.extra)
        digests = kept_digests(claim.row_key, claim.history, call)  # its next call's state chain is this one's
        self.context = CallContext(claim.history, call, claim.rollout.rollout_id, epoch, None, trace, *digests)
        self.phases = Phases()
        self.answer = None
        self.flight: Flight | None = None
        self.lane = lane_current()
        self.waited = bool(self.lane and self.lane.waited_s)  # on the event loop, before this run
        if self.waited:
            self.phases.ms["wait"] = self.lane.waited_s * 1000

    def drive(self, detached: bool, started: float) -> CallOutcome | HandBack:
        lane = self.lane
        protocol = RolloutCall(
            detached=detached,
            fast_lane=lane is not None and lane.fast,
            may_wait=lane is None or lane.may_wait(),
            rebuilds=True,
        )
        # Off the hits' lane, where a rollout that finds the call claimed hands its request back to
        # wait, the lookup takes the single-flight claim in its own statement (one round trip less
        # per miss). Elsewhere the lookup does not: a request that executes alongside a leader it
        # waited for too long needs the lookup's match, which a claimed call's answer lacks.
        claims = lane is not None and not lane.fast and protocol.may_wait
        step = protocol.start()
        while True:
            act = step.act
            if act is Act.LOOKUP:
                step = protocol.looked_up(self._lookup(claim=claims and self.flight is None))
            elif act is Act.MOVE:
                self._lease_drop()
                return self._handed_back(protocol, SlowWork())
            elif act is Act.LEAD:
                self.flight = Flight(step.key, self.answer, self.rollout.rollout_id)
                led = self.flight.try_lead()
                step = protocol.lead_tried(led, step.key)
                if not led:
                    self.flight = None
            elif act is Act.AWAIT:
                if lane is not None:  # waits on the event loop, holding no thread, then runs again
                    self._lease_drop()
                    return self._handed_back(protocol, ClaimAwaited(step.key, settings.TVCACHE["SINGLE_FLIGHT_WAIT_S"]))
                step = protocol.awaited(timed_out=not self._wait(step.key))
            elif act is Act.SERVE:
                result, node_id = self._serve_hit(step.append)
                return self._outcome(protocol, started, result, True, node_id, step.append)
            elif act is Act.RUN_AS_IS:
                with self.phases.timed("exec"):
                    result = _serve_detached(self.rollout, self.call)
                return self._outcome(protocol, started, result, False, None, True)
            else:  # EXECUTE
                return self._execute(protocol, started)

    def _lookup(self, *, claim: bool = False) -> Looked:
        self._lease_drop()  # (a lane that serves hits takes no lease: a miss moves on, core/lanes.py)
        with self.phases.timed("lookup"):
            self.answer = tcg_lookup(
                task_id=self.handle.task_id,
                context=self.context,
                count=False,
                claim=claim,
                resume=not self.has_sandbox and not (self.lane is not None and self.lane.fast),
            )
        if self.flight is not None and isinstance(self.answer, LookupHit):
            self.flight.release()  # its leader recorded it: nothing to lead
            self.flight = None
        return looked(task=self.handle, context=self.context, answer=self.answer)

    def _wait(self, key) -> bool:
        """Wait in this thread while another rollout leads; False if it led too long."""
        flight, waited = Flight(key, self.answer, self.rollout.rollout_id), time.perf_counter()
        led = flight.wait_to_lead()
        self.waited = True
        self.phases.ms["wait"] = self.phases.ms.get("wait", 0.0) + (time.perf_counter() - waited) * 1000
        self.flight = flight if led else None
        return led

    def _serve_hit(self, append: bool) -> tuple[Any, int]:
        answer, task_id = self.answer, self.handle.task_id
        hit_count(task_id=task_id, context=self.context, hit=answer)
        if answer.audit:  # sampled: a worker re-executes it at this state and compares
            hit_audit_enqueue(
                task_id=task_id,
                node_id=answer.node_id,
                rollout_pk=self.rollout.pk,
                applied=len(self.history),
                backend=self.handle.backend,
            )
        if append:
            rollout_history_append(rollout_pk=self.rollout.pk, call=self.call, length=len(self.history))
            if self.has_sandbox:  # its sandbox is a call behind now: it catches up while the policy thinks
                catch_up_after_answer(task_id, self.rollout, (*self.history, self.call), answer.node_id)
        return orjson.loads(answer.result_json), answer.node_id

    def _execute(self, protocol: RolloutCall, started: float) -> CallOutcome:
        task_id, answer = self.handle.task_id, self.answer
        lookup_count(
            task_id=task_id,
            context=self.context,
            node_id=None,
            hit=False,
            seen=answer.seen or self.waited,
            state_seen=answer.seen or self.waited or answer.state_seen,
            saved_ms=0.0,
        )
        with self.phases.timed_outside("prepare"):
            # A rollout with a sandbox of its own marks it `executing` in the task's read (one
            # round trip), given back if the task refuses the miss.
            rider = own_marked(self.rollout.pk, len(self.history)) if self.has_sandbox else None
            task, marked = task_for_miss(task_id=task_id, rider=rider)
            try:
                if task is None:  # deleted since the lookup
                    raise unknown_task(task_id)
                backend = backend_named(task.env.get("backend", "external"))
                _granted(task)
            except BaseException:
                if marked is not None:
                    unmarked(marked)
                raise
            if not self.has_sandbox:  # the state it needs may be being snapshotted: better forked than replayed
                answer = self.answer = resume_snapshotted(task_id, self.context, answer, self.phases)
        self.answer = None  # its lease is the execution's to release
        execution = miss_execute(task, backend, self.rollout, self.context, answer, self.phases, marked=marked)
        step = protocol.executed(execution.ran, reason=execution.reason)
        node_id, mutates = None, True
        if step.act is Act.RECORD:
            node_id, mutates = miss_record(execution, protocol, self.context, self._recorded, self.phases)
        elif step.act is Act.DETACH:
            miss_detach(execution, answer, self.context, step.reason)
        elif step.act is Act.RETIRE:
            retire(execution.run.row, step.reason)
        if execution.error is not None:
            protocol.logged(self.rollout.rollout_id)
            raise execution.error
        return self._outcome(protocol, started, execution.result, False, node_id, mutates)

    def _release(self) -> None:
        if self.flight is not None:
            self.flight.release()
            self.flight = None

    def _recorded(self, key: tuple[str, str]) -> None:
        if self.flight is not None:
            self.flight.release(recorded=key)
            self.flight = None

    def _lease_drop(self) -> None:
        answer, self.answer = self.answer, None
        if isinstance(answer, LookupMiss) and answer.lease_id:
            lease_release(lease_id=answer.lease_id)

    def _outcome(self, protocol, started, result, cached: bool, node_id, mutates: bool) -> CallOutcome:
        protocol.logged(self.rollout.rollout_id)
        return CallOutcome(result, cached, node_id, (time.perf_counter() - started) * 1000, mutates, self.phases.ms)

    def _handed_back(self, protocol, handed: HandBack) -> HandBack:
        protocol.logged(self.rollout.rollout_id)
        return handed

    def close(self) -> None:
        self._release()
        self._lease_drop()
        with self.phases.timed("claim"):  # (the answer's phases_ms is this dict: serialized after this)
            rollout_unclaim(rollout_pk=self.rollout.pk)


def _granted(task: Task) -> None:
    """A miss starts or forks a sandbox: the task's env must still be within its project's grants
    (an operator may have narrowed them since the task was put): 403 otherwise."""
    try:
        env_check_granted(task.env, project=task.project)
    except SandboxError as exc:
        raise as_application_error(exc) from None


def _serve_detached(rollout: Rollout, call: ToolCall) -> Any:
    """A detached rollout's call: in its own sandbox as it is, uncached and unrecorded."""
    row = Sandbox.objects.filter(rollout=rollout, state=Sandbox.State.LEASED).first()
    if row is None:
        raise Conflict(
            "The rollout's sandbox is in an unknown state and gone (an earlier call timed out, was killed "
            "or failed mid-way): end the rollout.",
            code="rollout_state_unknown",
        )
    Sandbox.objects.filter(pk=row.pk).update(lease_expires_at=idle_deadline(busy=True))
    try:
        result = sandbox_handle(row).execute(call.tool, call.args)
    except SandboxGone as exc:
        retire(row, exc.message)
        raise as_application_error(exc) from None
    except SandboxError as exc:
        raise as_application_error(exc) from None
    Sandbox.objects.filter(pk=row.pk).update(lease_expires_at=idle_deadline())
    return result


class _RanLast:
    """The rollouts (task as the trainer names it, rollout) whose last call this process answered
    ran its tool: a guess of where their next call goes, never a fact anything relies on. Bounded:
    the least recently noted are forgotten first."""

    def __init__(self, size: int = 10_000):
        self._size = size
        self._keys: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, key: tuple[str, str], ran: bool) -> None:
        with self._lock:
            if not ran:
                self._keys.pop(key, None)
                return
            self._keys[key] = None
            self._keys.move_to_end(key)
            if len(self._keys) > self._size:
                self._keys.popitem(last=False)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._keys


_ran_last = _RanLast()


def rollout_ran_note(*, task_id: str, rollout_id: str, ran: bool) -> None:
    """The rollout's call just answered ran its tool (a miss), or not (a hit, or the rollout ended)."""
    _ran_last.note((task_id, rollout_id), ran)


def rollout_ran_last(*, task_id: str, rollout_id: str) -> bool:
    """The rollout's last call that this process answered ran its tool: its next one most likely
    misses too (it is in a state that no other rollout had reached)."""
    return (task_id, rollout_id) in _ran_last


def rollout_end(*, task_id: str, rollout_id: str) -> None:
    rollout = Rollout.objects.filter(task_id=task_id, rollout_id=rollout_id).first()
    if rollout is None:
        raise NotFound(f"Task '{task_public_id(task_id)}' has no rollout '{rollout_id}'.", code="unknown_rollout")
    Rollout.objects.filter(pk=rollout.pk, finished_at__isnull=True).update(finished_at=timezone.now())
    for sandbox_id in Sandbox.objects.filter(rollout=rollout, state=Sandbox.State.LEASED).values_list("pk", flat=True):
        sandbox_stop(sandbox_id=sandbox_id)
