"""Tool-server mode: the service keeps each rollout's history and runs its misses.

Hits need no sandbox. The first miss of a rollout materializes one: a ready pre-fork of the
resume snapshot, else a fork on the critical path, else a ready root (or a fresh start) plus
replay. Later misses continue in it, replaying first the state-changing calls that hit since.

The rollout's history holds the calls that changed its state: a hit on a read-only node, or a
miss that the sandbox observed to change nothing (a `cat` in a docker sandbox), is left out, so
the rollout's later calls match those of rollouts that did not make it.

Known-state rule (DESIGN.md): a call that timed out, was killed, or after which the backend failed
leaves the sandbox in an unknown state. Its rollout is detached: it leaves the shared graph and
its later calls run in its own sandbox, uncached and unrecorded, so nothing it sees is ever filed
under a state key it may not have reached. A sandbox is marked `executing` (committed) before a
call runs in it; a rollout that finds its sandbox still marked (the server was killed mid-call)
retires it, since it may be ahead of the history.

Verify, don't trust: a sandbox materialized for a node (a fork, a pre-fork, a replay) is compared
with the state fingerprint the node's call left behind before the new call runs in it. A mismatch
is a divergence (counted per task, tool and node); the sandbox is retired and the state rebuilt
by a replay from the root; if that does not match either, the call is answered uncached and the
rollout detached.

Rollouts of a task run in parallel and start alike, so they often miss on the same call in the
same state at the same moment. Only one of them executes it (single flight): the others wait for
its result and are answered from the cache, and their sandboxes catch up on their next miss.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from django.utils import timezone

from cache.errors import Conflict, Forbidden, NotFound
from cache.inputs import CallContext, RecordInput
from cache.lanes import on_fast_lane, slow_lane_needed
from cache.models import Divergence, Node, Rollout, Snapshot, Task
from cache.projects import task_public_id, unknown_task
from cache.services import (LookupHit, TaskHandle, divergence_record, lease_release, lookup_count, node_record,
                            rollout_claim, rollout_detach, rollout_history_append, rollout_unclaim, single_flight,
                            snapshot_register, task_handle, tcg_lookup)
from cache.services.background import job_enqueue
from cache.tcg import TaskPolicy, ToolCall
from observability import metrics
from sandboxes.backends.base import Sandbox as SandboxHandle
from sandboxes.backends.base import (DiskQuotaExceeded, EngineUnreachable, InvalidToolArgs, SandboxBackend, SandboxError, SandboxGone,
                                     SandboxTampered, SnapshotMissing, ToolNotFound)
from sandboxes.models import Sandbox

from .audit import hit_audit_enqueue
from .pools import idle_deadline, prefork_if_room, sandbox_acquire, sandbox_row, sandbox_stop, set_state
from .runtime import as_application_error, backend_named, env_check_granted, forget, handle, labels, remember

log = logging.getLogger("tvcache.toolserver")

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


class Phases:
    """Where a call's time goes: lookup, wait (single flight), materialize (start or fork),
    replay, verify (state fingerprints), exec, fingerprint (of the new state), record, snapshot."""

    def __init__(self):
        self.ms: dict[str, float] = {}

    @contextmanager
    def timed(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - started) * 1000


@dataclass
class _Run:
    """One miss being served: the task, its backend, the rollout's sandbox."""

    task: Task
    backend: SandboxBackend
    policy: TaskPolicy
    rollout: Rollout
    row: Sandbox
    sandbox: SandboxHandle
    phases: Phases
    restore_ms: float | None = None  # set when it was forked from a snapshot on the critical path
    diverged: str = ""  # why the sandbox does not reach the recorded state (then nothing is recorded)


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
                result = _serve_detached(handle, rollout, call)
            return CallOutcome(result, False, None, (time.perf_counter() - started) * 1000, True, phases.ms)
        context = CallContext(history, call, rollout_id, epoch, None)
        # A rollout with a sandbox replays what it missed in it: a miss needs no snapshot's lease
        # (if the sandbox is gone by then, the miss starts a fresh one and replays everything).
        with phases.timed("lookup"):  # (a lane that serves hits takes no lease: a miss moves on, cache/lanes.py)
            answer = tcg_lookup(task_id=task_id, context=context, count=False, resume=not has_sandbox and not on_fast_lane())
        with single_flight(task=handle, context=context, answer=answer, resume=not has_sandbox,
                           timings=phases.ms) as flight:
            answer = flight.answer
            if isinstance(answer, LookupHit):
                lookup_count(task_id=task_id, context=context, node_id=answer.node_id, hit=True, seen=True,
                             saved_ms=answer.exec_ms)
                result, node_id, cached = orjson.loads(answer.result_json), answer.node_id, True
                mutates, on_graph = answer.mutates, True
                if answer.audit:  # sampled: a worker re-executes it at this state and compares
                    hit_audit_enqueue(task_id=task_id, node_id=node_id, rollout_pk=rollout.pk, applied=len(history))
            else:
                lookup_count(task_id=task_id, context=context, node_id=None, hit=False, seen=answer.seen or flight.waited,
                             saved_ms=0.0)
                task = Task.objects.select_related("project").filter(pk=task_id).first()
                if task is None:  # deleted since the lookup
                    raise unknown_task(task_id)
                backend = backend_named(task.env.get("backend", "external"))
                _granted(task)
                result, node_id, mutates, on_graph = _serve_miss(task, backend, rollout, context, answer,
                                                                 recorded=flight.release, phases=phases)
                cached = False
        if mutates and on_graph:
            rollout_history_append(rollout_pk=rollout.pk, call=call, length=len(history))
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


def _serve_miss(task, backend, rollout, context: CallContext, answer, recorded,
                phases: Phases) -> tuple[Any, int | None, bool, bool]:
    """The call executed in the rollout's sandbox: its result, node, whether it changed the state,
    and whether the rollout is still on the shared graph (False: it was detached)."""
    restore_ms = None
    try:
        run = _rollout_sandbox(task, backend, rollout, context, answer, phases)
        restore_ms = run.restore_ms
    finally:  # the lookup's lease, used or not (its sandbox may have been reaped, or a pre-fork taken)
        if answer.lease_id:
            lease_release(lease_id=answer.lease_id, restore_ms=restore_ms)
    _mark_executing(run)
    try:
        with phases.timed("exec"):
            result, exec_ms, observed = _execute(run, context.call)
    except SandboxGone as exc:  # gone with whatever the call did: the next call starts from the history
        _retire(run.row, run.backend, exc.message)
        raise as_application_error(exc) from None
    except (ToolNotFound, InvalidToolArgs, DiskQuotaExceeded, EngineUnreachable) as exc:  # refused before it ran: the sandbox is as it was
        _executed(run, applied=len(context.history))
        raise as_application_error(exc) from None
    except SandboxTampered as exc:  # the rollout's own doing: it leaves the graph, its sandbox retired
        _detach(run, f"{exc.code}: {exc.message}", retire=True)
        raise as_application_error(exc) from None
    except SandboxError as exc:  # failed once the call may have run (a broken stream, an engine restart):
        # the sandbox may be ahead of the history, so it is retired; the rollout, which got an error
        # for the call, goes on from its history in a fresh sandbox
        _retire(run.row, run.backend, f"failed once its call may have run: {exc.code}: {exc.message}")
        raise as_application_error(exc) from None
    if result.get("timed_out") or run.diverged:
        _detach(run, run.diverged or "the call timed out and was killed: its effects are unknown")
        return result, None, True, False
    try:
        mutates = run.policy.for_tool(context.call.tool).changes_state(observed)
        with phases.timed("fingerprint"):
            state = run.sandbox.state_fingerprint() if mutates else None
        with phases.timed("record"):
            outcome = node_record(task_id=task.pk, record=RecordInput(context, result, exec_ms, observed),
                                  state=(state.full, state.shape) if state else ("", ""))
        recorded()  # rollouts waiting for this call take its result now, not after the snapshot
        if outcome.snapshot_wanted:
            with phases.timed("snapshot"):
                _snapshot(run, outcome.node_id)
        _executed(run, applied=len(context.history) + int(mutates))
    except SandboxTampered as exc:
        _detach(run, f"{exc.code}: {exc.message}", retire=True)
        raise as_application_error(exc) from None
    except BaseException:
        _retire(run.row, run.backend, "failed after its call ran: its state is ahead of the rollout's history")
        raise
    return result, outcome.node_id, mutates, True


def _serve_detached(task: TaskHandle, rollout: Rollout, call: ToolCall) -> Any:
    """A detached rollout's call: in its own sandbox as it is, uncached and unrecorded."""
    row = Sandbox.objects.filter(rollout=rollout, state=Sandbox.State.LEASED).first()
    if row is None:
        raise Conflict("The rollout's sandbox is in an unknown state and gone (an earlier call timed out, was killed "
                       "or failed mid-way): end the rollout.", code="rollout_state_unknown")
    backend = backend_named(task.backend)
    Sandbox.objects.filter(pk=row.pk).update(lease_expires_at=idle_deadline(busy=True))
    try:
        result = handle(backend, row.ref).execute(call.tool, call.args)
    except SandboxGone as exc:
        _retire(row, backend, exc.message)
        raise as_application_error(exc) from None
    except SandboxError as exc:
        raise as_application_error(exc) from None
    Sandbox.objects.filter(pk=row.pk).update(lease_expires_at=idle_deadline())
    return result


def _mark_executing(run: _Run) -> None:
    """Committed before the call runs: a server killed before `_executed` leaves the mark, and
    the rollout's next call retires the sandbox instead of trusting it. The idle deadline moves
    past the longest call, so a long call is never reaped mid-run."""
    Sandbox.objects.filter(pk=run.row.pk).update(executing=True, lease_expires_at=idle_deadline(busy=True))


def _executed(run: _Run, *, applied: int) -> None:
    Sandbox.objects.filter(pk=run.row.pk).update(executing=False, applied=applied, lease_expires_at=idle_deadline())
    run.row.applied = applied


def _detach(run: _Run, reason: str, *, retire: bool = False) -> None:
    """Take the rollout off the shared graph (known-state rule). It keeps its sandbox, unless the
    sandbox cannot be trusted with another call; nothing is snapshotted from it."""
    rollout_detach(rollout=run.rollout, reason=reason)
    if retire:
        _retire(run.row, run.backend, reason)
    else:
        Sandbox.objects.filter(pk=run.row.pk).update(executing=False, lease_expires_at=idle_deadline())


def _retire(row: Sandbox, backend: SandboxBackend, reason: str) -> None:
    """Take the sandbox away from the rollout; its next call materializes a new one."""
    set_state(row, Sandbox.State.FAILED, rollout=None, error=reason)
    forget(row.backend, row.ref)
    try:
        backend.remove_sandbox(row.ref)
    except SandboxError:  # the orphan reaper removes it later
        pass


def _execute(run: _Run, call: ToolCall) -> tuple[dict, float, bool | None]:
    started = time.perf_counter()
    result, observed = run.sandbox.execute_observed(call.tool, call.args)
    return result, (time.perf_counter() - started) * 1000, observed


def _rollout_sandbox(task, backend, rollout, context: CallContext, answer, phases: Phases) -> _Run:
    """The rollout's sandbox brought up to date with its history (everything before the call) and
    checked against the state its history's node recorded: its own sandbox, else a materialized
    one (a pre-fork, a fork, a ready root), else, when that diverged, a fresh one replayed from the
    root. A sandbox whose replay failed midway is retired: its state is unknown."""
    policy = TaskPolicy.from_json(task.tools)
    row = Sandbox.objects.filter(rollout=rollout, state=Sandbox.State.LEASED).first()
    if row is not None and row.executing:
        _retire(row, backend, "cut off mid-call (the server stopped): it may be ahead of the rollout's history")
        row = None
    try:
        if row is not None:
            run = _Run(task, backend, policy, rollout, row, handle(backend, row.ref), phases)
            pending = [c for c in context.history[row.applied:] if policy.for_tool(c.tool).mutates_state]
            if not pending or _caught_up(run, pending, context, answer):
                return run
        else:
            with phases.timed("materialize"):
                run = _materialize(task, backend, policy, rollout, answer, phases)
            replay = run_replay(answer, run)
            if not (replay or run.row.pool == Sandbox.Pool.FORK) or _caught_up(run, replay, context, answer):
                return run
        return _from_root(task, backend, policy, rollout, context, answer, phases)
    except SandboxError as exc:
        raise as_application_error(exc) from None


def _caught_up(run: _Run, calls, context: CallContext, answer) -> bool:
    """Replay `calls` and verify; False when the sandbox diverged or died (it is retired then).
    Another failure midway retires it and raises."""
    try:
        if _replay_verified(run, calls, context, answer):
            return True
        _retire(run.row, run.backend, f"diverged from its history: {run.diverged}")
    except SandboxGone as exc:
        _retire(run.row, run.backend, exc.message)
    except SandboxError as exc:
        _retire(run.row, run.backend, f"its replay failed midway: {exc.code}: {exc.message}")
        raise
    return False


def _from_root(task, backend, policy, rollout, context: CallContext, answer, phases: Phases) -> _Run:
    """A fresh sandbox and a replay of the whole history, after another sandbox diverged. If this
    one does not reach the recorded state either, `diverged` says so and the call is answered
    uncached."""
    with phases.timed("materialize"):
        row = _start_leased(task, backend, rollout, None)
    if row is None:
        raise SandboxGone("could not start a fresh sandbox")
    run = _Run(task, backend, policy, rollout, row, handle(backend, row.ref), phases)
    if answer.full_replay:
        try:
            _replay_verified(run, answer.full_replay, context, answer)
        except SandboxError:
            _retire(row, backend, "its replay from the root failed midway")
            raise
    return run


def run_replay(answer, run: _Run) -> tuple[ToolCall, ...]:
    resume = answer.match.resume
    if run.row.pool == Sandbox.Pool.FORK and resume is not None and run.row.snapshot_id == resume.snapshot_id:
        return answer.match.replay
    return answer.full_replay


def _materialize(task, backend, policy, rollout, answer, phases: Phases) -> _Run:
    resume = answer.match.resume
    snapshot = None
    if resume is not None:
        snapshot = Snapshot.objects.filter(pk=resume.snapshot_id, owner=Snapshot.Owner.SERVICE,
                                           backend=backend.name).first()
    if snapshot is not None:
        row, restore_ms = sandbox_acquire(task_id=task.pk, snapshot_id=snapshot.pk, rollout_pk=rollout.pk), None
        if row is None:
            row = _start_leased(task, backend, rollout, snapshot)
            restore_ms = row.start_ms if row is not None else None
        if row is not None:
            prefork_if_room(task_id=task.pk, snapshot_id=snapshot.pk)  # keep a fork of a hot snapshot ready
            return _Run(task, backend, policy, rollout, row, handle(backend, row.ref), phases, restore_ms)
    row = sandbox_acquire(task_id=task.pk, snapshot_id=None, rollout_pk=rollout.pk) or _start_leased(
        task, backend, rollout, None)
    return _Run(task, backend, policy, rollout, row, handle(backend, row.ref), phases)


def _start_leased(task, backend, rollout, snapshot) -> Sandbox | None:
    """Start (or fork) a sandbox on the critical path, leased to the rollout from the outset."""
    row = sandbox_row(task=task, backend=backend.name, rollout=rollout, state=Sandbox.State.WARMING,
                      pool=Sandbox.Pool.FORK if snapshot else Sandbox.Pool.ROOT, snapshot=snapshot)
    started = time.perf_counter()
    try:
        if snapshot is not None:
            sandbox = backend.fork(snapshot.ref, task.env, labels=labels(task.pk, row.pk))
        else:
            sandbox = backend.start(task.env, labels=labels(task.pk, row.pk))
    except SnapshotMissing:
        set_state(row, Sandbox.State.FAILED, error="snapshot missing")
        return None
    except SandboxError as exc:
        set_state(row, Sandbox.State.FAILED, error=f"{exc.code}: {exc.message}")
        raise
    remember(backend, sandbox)
    set_state(row, Sandbox.State.LEASED, ref=sandbox.sandbox_id, ready_at=timezone.now(),
              start_ms=(time.perf_counter() - started) * 1000, lease_expires_at=idle_deadline())
    metrics.sandbox_started(backend=backend.name, forked=snapshot is not None, path="critical", ms=row.start_ms)
    return row


def _replay_verified(run: _Run, calls, context: CallContext, answer) -> bool:
    """Re-execute state-changing calls whose results are known, to rebuild the state, and compare
    the sandbox with the fingerprint the history's last node recorded. False (and `diverged` set,
    a divergence recorded) when a replayed call timed out or the state differs."""
    history = context.history
    with run.phases.timed("replay"):  # a failure midway raises: the callers retire the sandbox
        for call in calls:
            if run.sandbox.execute(call.tool, call.args).get("timed_out"):
                run.diverged = f"the replay of {call.tool} timed out"
                break
    if not run.diverged:
        Sandbox.objects.filter(pk=run.row.pk).update(applied=len(history))
        run.row.applied = len(history)
    node = answer.match.node
    if node is None or answer.match.matched != len(history):
        return not run.diverged  # no node holds the whole history's state: nothing to compare with
    # A bare fork must be an exact copy; a replay ran at another time (StateDigest).
    column = "state_shape" if calls else "state_fingerprint"
    with run.phases.timed("verify"):
        expected, tool = Node.objects.filter(pk=node.node_id).values_list(column, "tool").first() or ("", "")
        state = run.sandbox.state_fingerprint() if expected and not run.diverged else None
    actual = (state.shape if calls else state.full) if state else None
    if actual is not None and actual != expected:
        run.diverged = f"its state ({column}) {actual[:12]} is not node {node.node_id}'s {expected[:12]}"
    if run.diverged:
        divergence_record(task_id=run.task.pk, node_id=node.node_id, tool=tool, kind=Divergence.Kind.STATE,
                          expected={"fingerprint": expected},
                          observed={"fingerprint": actual, "sandbox": run.row.pool, "why": run.diverged},
                          rollout_id=run.rollout.rollout_id)
    return not run.diverged


def _snapshot(run: _Run, node_id: int) -> None:
    """Snapshot on the critical path (the state is only here now); a worker makes it a ready fork.
    A failed snapshot costs only the reuse it would have given: the call still succeeds."""
    try:
        info = run.sandbox.snapshot(labels=labels(run.task.pk))
    except SandboxError as exc:
        log.warning("snapshot of sandbox %s failed: %s", run.row.ref, exc)
        return
    metrics.snapshot_committed(backend=run.backend.name, ms=info.create_ms)
    try:
        snapshot, evicted = snapshot_register(task_id=run.task.pk, node_id=node_id, ref=info.ref,
                                              backend=run.backend.name, size_bytes=info.size_bytes,
                                              create_ms=info.create_ms, owner=Snapshot.Owner.SERVICE)
    except (Conflict, Forbidden) as exc:  # another rollout's snapshot of the same node won, or over the project's bytes
        if isinstance(exc, Forbidden):
            log.info("snapshot of node %s not kept: %s", node_id, exc.message)
        run.backend.delete_snapshot(info.ref)
        return
    prefork_if_room(task_id=run.task.pk, snapshot_id=snapshot.pk)
    if evicted:
        from workers.tasks import snapshots_collect as collect_task

        job_enqueue(collect_task)


def rollout_end(*, task_id: str, rollout_id: str) -> None:
    rollout = Rollout.objects.filter(task_id=task_id, rollout_id=rollout_id).first()
    if rollout is None:
        raise NotFound(f"Task '{task_public_id(task_id)}' has no rollout '{rollout_id}'.", code="unknown_rollout")
    Rollout.objects.filter(pk=rollout.pk, finished_at__isnull=True).update(finished_at=timezone.now())
    for sandbox_id in Sandbox.objects.filter(rollout=rollout, state=Sandbox.State.LEASED).values_list("pk", flat=True):
        sandbox_stop(sandbox_id=sandbox_id)
