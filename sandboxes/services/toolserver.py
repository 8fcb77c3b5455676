"""Tool-server mode: the service keeps each rollout's history and runs its misses.

A call is looked up; a hit needs no sandbox. A miss is led by one rollout at a time (single
flight: the others wait for its result and are answered from the cache, their sandboxes catching
up on their next miss), executed in the rollout's sandbox brought to its history's state
(materialize.py) under the known-state rule (misses.py), and recorded.

A rollout that has a sandbox and hits a state-changing call has its sandbox catch up after the
answer, while the policy thinks (materialize.catch_up_after_answer), so its next miss need not.

The rollout's history holds the calls that changed its state: a hit on a read-only node, or a
miss that the sandbox observed to change nothing (a `cat` in a docker sandbox), is left out, so
the rollout's later calls match those of rollouts that did not make it. A detached rollout's
calls run in its own sandbox as it is, uncached and unrecorded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from django.utils import timezone

from cache.errors import Conflict, NotFound
from cache.lanes import on_fast_lane, slow_lane_needed
from cache.models import Rollout, Task
from cache.projects import task_public_id, unknown_task
from cache.services import (
    LookupHit,
    lookup_count,
    rollout_claim,
    rollout_history_append,
    rollout_unclaim,
    single_flight,
    task_handle,
    tcg_lookup,
)
from cache.tcg import ToolCall
from cache.tcg.records import CallContext
from sandboxes.backends.base import SandboxError, SandboxGone
from sandboxes.handles import as_application_error, backend_named, env_check_granted, sandbox_handle
from sandboxes.models import Sandbox

from .audit import hit_audit_enqueue
from .materialize import Phases, catch_up_after_answer, resume_snapshotted, retire
from .misses import serve_miss
from .pools import idle_deadline, sandbox_stop

# The rollout_claim column of tool-server mode: the rollout has a sandbox of its own, which it
# brings up to date rather than fork a snapshot (its lookups then lease none).
HAS_SANDBOX_SQL = "EXISTS (SELECT FROM sandboxes_sandbox s WHERE s.rollout_id = r.id AND s.state = 'leased')"


@dataclass(frozen=True, slots=True)
class CallOutcome:
    result: Any
    cached: bool
    node_id: int | None
    latency_ms: float
    mutates: bool  # the call changed the rollout's state (it is part of the history now)
    phases_ms: dict[str, float] = field(default_factory=dict)  # where the time went (Phases)


def rollout_call(*, task_id: str, rollout_id: str, call: ToolCall, epoch: int = 0) -> CallOutcome:
    """Four statements for a hit (claim and read the rollout, the lookup, the history append,
    the release); the task's row and a sandbox only for a miss."""
    started = time.perf_counter()
    handle = task_handle(task_id=task_id, cached=True)  # outdated at worst: the lookup checks its version
    try:
        backend_named(handle.backend).tool_spec(call.tool)
    except SandboxError as exc:
        raise as_application_error(exc) from None
    claim = rollout_claim(task_id=task_id, rollout_id=rollout_id, epoch=epoch, extra_column=HAS_SANDBOX_SQL)
    rollout, history, has_sandbox, detached = claim.rollout, claim.history, claim.extra, claim.detached
    phases = Phases()
    try:
        if detached:
            slow_lane_needed()  # (cache/lanes.py)
            with phases.timed("exec"):
                result = _serve_detached(rollout, call)
            return CallOutcome(result, False, None, (time.perf_counter() - started) * 1000, True, phases.ms)
        context = CallContext(history, call, rollout_id, epoch, None)
        # A rollout with a sandbox replays what it missed in it: a miss needs no snapshot's lease
        # (if the sandbox is gone by then, the miss starts a fresh one and replays everything).
        with phases.timed("lookup"):  # (a lane that serves hits takes no lease: a miss moves on, cache/lanes.py)
            answer = tcg_lookup(
                task_id=task_id, context=context, count=False, resume=not has_sandbox and not on_fast_lane()
            )
        with single_flight(
            task=handle, context=context, answer=answer, resume=not has_sandbox, timings=phases.ms
        ) as flight:
            answer = flight.answer
            if isinstance(answer, LookupHit):
                lookup_count(
                    task_id=task_id,
                    context=context,
                    node_id=answer.node_id,
                    hit=True,
                    seen=True,
                    saved_ms=answer.exec_ms,
                )
                result, node_id, cached = orjson.loads(answer.result_json), answer.node_id, True
                mutates = answer.mutates
                if answer.audit:  # sampled: a worker re-executes it at this state and compares
                    hit_audit_enqueue(
                        task_id=task_id,
                        node_id=node_id,
                        rollout_pk=rollout.pk,
                        applied=len(history),
                        backend=handle.backend,
                    )
            else:
                lookup_count(
                    task_id=task_id,
                    context=context,
                    node_id=None,
                    hit=False,
                    seen=answer.seen or flight.waited,
                    saved_ms=0.0,
                )
                task = Task.objects.select_related("project").filter(pk=task_id).first()
                if task is None:  # deleted since the lookup
                    raise unknown_task(task_id)
                backend = backend_named(task.env.get("backend", "external"))
                _granted(task)
                if not has_sandbox:  # the state it needs may be being snapshotted: better forked than replayed
                    answer = resume_snapshotted(task_id, context, answer, phases)
                result, node_id, mutates = serve_miss(
                    task, backend, rollout, context, answer, recorded=flight.release, phases=phases
                )
                cached = False
        if mutates and cached:  # (a miss appended its call with its record: misses.py)
            rollout_history_append(rollout_pk=rollout.pk, call=call, length=len(history))
            if has_sandbox:  # its sandbox is a call behind now: it catches up while the policy thinks
                catch_up_after_answer(task_id, rollout, (*history, call), node_id)
    finally:
        rollout_unclaim(rollout_pk=rollout.pk)
    return CallOutcome(result, cached, node_id, (time.perf_counter() - started) * 1000, mutates, phases.ms)


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


def rollout_end(*, task_id: str, rollout_id: str) -> None:
    rollout = Rollout.objects.filter(task_id=task_id, rollout_id=rollout_id).first()
    if rollout is None:
        raise NotFound(f"Task '{task_public_id(task_id)}' has no rollout '{rollout_id}'.", code="unknown_rollout")
    Rollout.objects.filter(pk=rollout.pk, finished_at__isnull=True).update(finished_at=timezone.now())
    for sandbox_id in Sandbox.objects.filter(rollout=rollout, state=Sandbox.State.LEASED).values_list("pk", flat=True):
        sandbox_stop(sandbox_id=sandbox_id)
