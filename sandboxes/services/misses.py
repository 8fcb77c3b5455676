"""A tool-server miss run in the rollout's sandbox, under the known-state rule (docs/design/guarantees.md).

A call that timed out, was killed, or after which the backend failed leaves the sandbox in an
unknown state. A timeout (or a call that broke the session agent running it) detaches the rollout:
it leaves the shared graph and its later calls run in its own sandbox, uncached and unrecorded, so
nothing it sees is ever filed under a state key it may not have reached. So does a state that
changes on its own (a process the rollout left running writes files): it depends on timing
(docs/design/state.md). A sandbox that died, or failed once the call
may have run, is retired: the rollout goes on from its history in a fresh one. A sandbox is
marked `executing` (committed) before a call runs in it; a rollout that finds its sandbox still
marked (the server was killed mid-call) retires it, since it may be ahead of the history.

The result is recorded (with the state fingerprint the call left), the rollouts waiting for the
same call are let go, and where the graph wants a snapshot it is taken after the answer: a thread
of this process commits the state the call left while the sandbox stays reserved to it
(reserved.py); the rollout's next miss, in whichever process, waits for it before it touches the
sandbox, while its hits never wait. A snapshot that fails costs only the reuse it would have given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cache.models import Divergence, Node, Snapshot
from cache.services import (
    KeptAppend,
    divergence_record,
    lease_release,
    node_record,
    rollout_detach,
    snapshot_register,
)
from cache.tcg import RecordedState, ToolCall
from cache.tcg.records import CallContext, CallRecord
from cache.tcg.rollout import Ran, RolloutCall
from core.background import job_enqueue
from core.errors import ApplicationError, Conflict, Forbidden
from observability import metrics
from sandboxes.backends.base import (
    DiskQuotaExceeded,
    EngineUnreachable,
    InvalidToolArgs,
    SandboxError,
    SandboxGone,
    SandboxTampered,
    ToolNotFound,
)
from sandboxes.engines import engine_queue
from sandboxes.handles import as_application_error, labels
from sandboxes.models import Sandbox

from .materialize import Phases, Run, retire, rollout_sandbox, unmarked
from .pools import idle_deadline, prefork_if_room
from .reserved import run_reserved

log = logging.getLogger("tvcache.toolserver")


@dataclass
class Execution:
    """A miss executed in the rollout's sandbox and observed, not recorded yet: what the rollout
    protocol decides on (cache/tcg/rollout.py). `error` is the call's answer instead of `result`."""

    run: Run
    ran: Ran
    result: Any = None
    error: ApplicationError | None = None
    reason: str = ""
    exec_ms: float = 0.0
    observed: bool | None = None  # the backend observed whether the call changed the state
    mutates: bool = False
    state: Any = None  # the state fingerprint the call left (a state-changing call's)
    drifted: bool = False  # the state its history reached changed on its own before the call
    untrusted: bool = False  # the sandbox cannot be trusted with another call


def miss_execute(
    task, backend, rollout, context: CallContext, answer, phases: Phases, *, marked: Sandbox | None = None
) -> Execution:
    """The call executed in the rollout's sandbox brought to its history's state, and what it did
    observed: how it ran (the known-state rule's input), its result and state fingerprint.
    `marked`: the rollout's own sandbox, marked `executing` already (materialize.own_marked)."""
    restore_ms = None
    with phases.timed_outside("prepare"):  # (materialize, replay and verify are phases of their own)
        try:
            run = rollout_sandbox(task, backend, rollout, context, answer, phases, marked=marked)
            restore_ms = run.restore_ms
        finally:  # the lookup's lease, used or not (its sandbox may have been reaped, or a pre-fork taken)
            if answer.lease_id:
                lease_release(lease_id=answer.lease_id, restore_ms=restore_ms)
        if not run.marked:
            _mark_executing(run)
    observing = run.sandbox.observed_ms()
    try:
        with phases.timed("exec"):
            result, exec_ms, observed = _execute(run, context.call)
        observing = _processes_phase(run, phases, "exec", observing)
    except SandboxGone as exc:  # gone with whatever the call did
        return Execution(run, Ran.ENV_FAILED, error=as_application_error(exc), reason=exc.message)
    except (
        ToolNotFound,
        InvalidToolArgs,
        DiskQuotaExceeded,
        EngineUnreachable,
    ) as exc:  # refused before it ran: the sandbox is as it was
        _executed(run, applied=len(context.history))
        return Execution(run, Ran.REFUSED, error=as_application_error(exc))
    except SandboxTampered as exc:  # the call broke what runs it (killed the session agent): its effects
        # are unknown; its sandbox stays its own, as it would without tvcache (a broken agent is replaced)
        return Execution(run, Ran.UNKNOWN, error=as_application_error(exc), reason=f"{exc.code}: {exc.message}")
    except SandboxError as exc:  # failed once the call may have run (a broken stream, an engine restart)
        reason = f"failed once its call may have run: {exc.code}: {exc.message}"
        return Execution(run, Ran.ENV_FAILED, error=as_application_error(exc), reason=reason)
    done = Execution(run, Ran.UNKNOWN, result=result, exec_ms=exec_ms, observed=observed)
    if result.get("timed_out") or run.diverged:
        done.reason = run.diverged or "the call timed out and was killed: its effects are unknown"
        return done
    if run.sandbox.state_drifted():  # the state the history reached kept changing: not a function of it
        done.drifted = True
        done.reason = (
            "the state the history reached kept changing between calls (a process left running writes "
            "files): it depends on timing"
        )
        return done
    try:
        done.mutates = run.policy.for_tool(context.call.tool).changes_state(observed)
        with phases.timed("fingerprint"):
            done.state = run.sandbox.state_fingerprint() if done.mutates else None
        _processes_phase(run, phases, "fingerprint", observing)
    except SandboxTampered as exc:
        done.error, done.untrusted, done.reason = as_application_error(exc), True, f"{exc.code}: {exc.message}"
        return done
    except BaseException:
        retire(run.row, "failed after its call ran: its state is ahead of the rollout's history")
        raise
    if done.state is not None and not done.state.settled:  # it changes on its own after the call
        done.reason = (
            "the state the call left kept changing after it returned (a process it left running "
            "writes files): it depends on timing"
        )
        return done
    done.ran = Ran.KNOWN
    return done


def miss_record(
    execution: Execution,
    rollout_call: RolloutCall,
    context: CallContext,
    recorded: Callable[[tuple[str, str]], None],
    phases: Phases,
) -> tuple[int, bool]:
    """The execution recorded under the rollout's history, with the sandbox's progress and the
    history's growth in one commit; a snapshot handed off where the graph wants one. `recorded`
    lets the rollouts waiting for this call go (given the node's (anchor, digest)). Its node and
    whether it joined the history."""
    run, state = execution.run, execution.state
    append = rollout_call.recorded(mutates=execution.mutates).append
    applied = len(context.history) + int(append)
    try:
        # One statement for the node, the sandbox's progress and the rollout's history: one round
        # trip and one commit (which waits for the disk), all of it or none.
        with phases.timed("record"):
            outcome = node_record(
                task_id=run.task.pk,
                record=CallRecord(context, execution.result, execution.exec_ms, execution.observed),
                state=RecordedState(state.full, state.shape, state.order, state.times, state.processes)
                if state
                else RecordedState(),
                keeps_processes=run.sandbox.keeps_processes,
                evicted=False,  # the service's own snapshots: nothing to tell a client
                append=KeptAppend(run.rollout.pk, len(context.history), context.call) if append else None,
                also=(
                    _PROGRESS_SQL,
                    {"sandbox": run.row.pk, "sandbox_applied": applied, "sandbox_idle": idle_deadline()},
                ),
            )
        run.row.applied = applied
        inline = False
        if outcome.snapshot_wanted:  # handed off before the rollouts waiting for this call see it pending
            with phases.timed("snapshot"):  # the hand-off: the snapshot itself is taken after the answer
                inline = not _snapshot_after_answer(run, outcome.node_id)
        recorded(outcome.key)  # rollouts waiting for this call take its result now, not after the snapshot
        if inline:
            snapshot_take(run, outcome.node_id)
    except SandboxTampered as exc:
        _detach(run, f"{exc.code}: {exc.message}", untrusted=True)
        raise as_application_error(exc) from None
    except BaseException:
        retire(run.row, "failed after its call ran: its state is ahead of the rollout's history")
        raise
    return outcome.node_id, append


def miss_detach(execution: Execution, answer, context: CallContext, reason: str) -> None:
    """Known-state rule: the rollout leaves the shared graph, nothing recorded. It keeps its
    sandbox unless the sandbox cannot be trusted with another call; a state that drifted stops
    its node being served."""
    if execution.drifted:
        _drifted(execution.run, answer, context)
    _detach(execution.run, reason, untrusted=execution.untrusted)


def _processes_phase(run: Run, phases: Phases, phase: str, since: float) -> float:
    """The time `phase` spent observing the sandbox's processes, moved to a phase of its own
    ("processes": what observing them costs a miss, docs/design/state.md)."""
    now = run.sandbox.observed_ms()
    if now > since:
        phases.ms[phase] = phases.ms.get(phase, 0.0) - (now - since)
        phases.ms["processes"] = phases.ms.get("processes", 0.0) + (now - since)
    return now


def _drifted(run: Run, answer, context: CallContext) -> None:
    """The sandbox's state changed on its own between the rollout's last call and this one (a process
    it keeps running writes files, or started or ended): the state the node of its history recorded
    depended on timing. That node stops being served (rollouts that reach it run its call live, each
    at its own time); this call's answer is its own sandbox's (the caller detaches the rollout)."""
    node = answer.match.node
    reached = node.node_id if node is not None and answer.match.matched == len(context.history) else None
    if reached is not None:
        tool = Node.objects.filter(pk=reached).values_list("tool", flat=True).first() or context.call.tool
        divergence_record(
            task_id=run.task.pk,
            node_id=reached,
            tool=tool,
            kind=Divergence.Kind.DRIFT,
            expected=None,
            observed={"sandbox": run.row.pool, "why": "the state changed between calls"},
            rollout_id=run.rollout.rollout_id,
        )


def _mark_executing(run: Run) -> None:
    """Committed before the call runs: a server killed before `_executed` leaves the mark, and
    the rollout's next call retires the sandbox instead of trusting it. The idle deadline moves
    past the longest call, so a long call is never reaped mid-run."""
    Sandbox.objects.filter(pk=run.row.pk).update(executing=True, lease_expires_at=idle_deadline(busy=True))


# The sandbox's progress, committed with the record in its statement (node_record's `also`).
_PROGRESS_SQL = """UPDATE sandboxes_sandbox SET executing = false, applied = %(sandbox_applied)s,
    lease_expires_at = %(sandbox_idle)s WHERE id = %(sandbox)s AND EXISTS (SELECT FROM go)"""


def _executed(run: Run, *, applied: int) -> None:
    Sandbox.objects.filter(pk=run.row.pk).update(executing=False, applied=applied, lease_expires_at=idle_deadline())
    run.row.applied = applied


def _detach(run: Run, reason: str, *, untrusted: bool = False) -> None:
    """Take the rollout off the shared graph (known-state rule). It keeps its sandbox, unless the
    sandbox cannot be trusted with another call (`untrusted`); nothing is snapshotted from it."""
    rollout_detach(rollout=run.rollout, reason=reason)
    if untrusted:
        retire(run.row, reason)
    else:
        unmarked(run.row)


def _execute(run: Run, call: ToolCall) -> tuple[dict, float, bool | None]:
    started = time.perf_counter()
    result, observed = run.sandbox.execute_observed(call.tool, call.args)
    return result, (time.perf_counter() - started) * 1000, observed


def _snapshot_after_answer(run: Run, node_id: int) -> bool:
    """The snapshot in a thread of this process, the sandbox reserved to it (reserved.py) so that
    the rollout's next miss waits for it, and the node's snapshot marked pending meanwhile; False
    if the reservation cannot be taken (the caller takes it on the critical path)."""
    return run_reserved(run.rollout.pk, lambda: snapshot_take(run, node_id), name="snapshot", snapshot_of=node_id)


def snapshot_take(run: Run, node_id: int, *, exact: bool = True, prefork: bool = True) -> None:
    """Snapshot of the state the call left (it is only in this sandbox); a worker makes it a
    ready fork. A failed snapshot costs only the reuse it would have given."""
    try:
        info = run.sandbox.snapshot(labels=labels(run.task.pk))
    except SandboxError as exc:
        log.warning("snapshot of sandbox %s failed: %s", run.row.ref, exc)
        return
    metrics.snapshot_committed(backend=run.backend.name, ms=info.create_ms)
    try:
        snapshot, evicted = snapshot_register(
            task_id=run.task.pk,
            node_id=node_id,
            ref=info.ref,
            backend=run.backend.name,
            engine=run.row.engine,
            size_bytes=info.size_bytes,
            create_ms=info.create_ms,
            owner=Snapshot.Owner.SERVICE,
            keeps_processes=info.keeps_processes,
            exact=exact,
        )
    except (Conflict, Forbidden) as exc:  # another rollout's snapshot of the same node won, or over the project's bytes
        if isinstance(exc, Forbidden):
            log.info("snapshot of node %s not kept: %s", node_id, exc.message)
        run.backend.delete_snapshot(info.ref)
        return
    if prefork:
        prefork_if_room(task_id=run.task.pk, snapshot_id=snapshot.pk)
    if evicted:
        for engine in set(
            Snapshot.objects.filter(task_id=run.task.pk, ref__in=evicted).values_list("engine", flat=True)
        ):
            job_enqueue("workers.tasks.snapshots_collect", engine, near=engine_queue(engine))
