"""Bringing a sandbox to the state a rollout's history says, for its next miss (tool-server mode).

The rollout's own sandbox is caught up by replaying the state-changing calls that hit since its
last miss. A rollout without one takes a ready pre-fork of the resume snapshot, else forks it on
the critical path, else takes a ready root (or starts one) and replays. A snapshot of a state with
live processes is never forked unless it keeps them (a checkpoint): the longest-prefix match offers
none (tcg.NodeRef.resumable), and the snapshot policy takes none (docs/design/state.md); a replay
from a state without them starts them again, and the fingerprint, processes included, checks it.

Verify, don't trust: a sandbox materialized for a node (a fork, a pre-fork, a replay) is compared
with the state fingerprint the node's call left behind before the new call runs in it. A mismatch
is a divergence (counted per task, tool and node); the sandbox is retired and the state rebuilt
by a replay from the root; if that does not match either, `Run.diverged` says so and the call is
answered uncached, its rollout detached (misses.py). A sandbox whose replay failed midway is
retired: its state is unknown.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

from django.utils import timezone

from cache.ledger import materialized_add, replay_add
from cache.models import Divergence, MaterializationStat, Node, Rollout, Snapshot, Task
from cache.selectors import Rider
from cache.services import (
    LookupMiss,
    backend_costs,
    divergence_record,
    history_catch_up,
    lease_grant,
    lease_release,
    replay_file_times,
    task_handle,
    tcg_lookup,
)
from cache.tcg import Match, TaskPolicy, ToolCall
from cache.tcg.records import CallContext
from observability import metrics
from sandboxes.backends.base import Sandbox as SandboxHandle
from sandboxes.backends.base import SandboxBackend, SandboxError, SandboxGone, SnapshotMissing
from sandboxes.engines import engines_for
from sandboxes.handles import as_application_error, forget, remember, sandbox_backend, sandbox_handle
from sandboxes.models import Sandbox

from .pools import idle_deadline, prefork_if_room, sandbox_acquire, sandbox_launch, sandbox_row, sandbox_stop, set_state
from .reserved import FREE, reservation_key, run_reserved, snapshot_pending, wait_snapshot, wait_unreserved

# How long a miss waits for the work on its rollout's sandbox after the previous answer (a snapshot,
# a catch-up: reserved.py); past it the work is stuck, and the sandbox is retired rather than
# touched while a commit may still read it.
RESERVED_WAIT_S = 300.0


class Phases:
    """Where a call's time goes: lanes (before the run that answers: the front door's lane queues
    and a run that handed the request on), claim (the rollout's, and its release), lookup, wait
    (single flight), background_wait (for the work on the rollout's sandbox after its previous
    answer: a snapshot, a catch-up), snapshot_wait (for a snapshot to fork rather than replay:
    resume_snapshotted), prepare (a miss's bookkeeping before its call runs: the task, the sandbox's
    row, its mark), materialize (start or fork), replay, verify (state fingerprints), exec,
    fingerprint (of the new state), processes (observing the processes the sandbox keeps running,
    taken out of exec and fingerprint), record, snapshot (its hand-off: it is taken after the
    answer)."""

    def __init__(self):
        self.ms: dict[str, float] = {}

    @contextmanager
    def timed(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - started) * 1000

    @contextmanager
    def timed_outside(self, name: str):
        """The block's time less that of the phases timed within it."""
        started, within = time.perf_counter(), sum(self.ms.values())
        try:
            yield
        finally:
            spent = (time.perf_counter() - started) * 1000 - (sum(self.ms.values()) - within)
            self.ms[name] = self.ms.get(name, 0.0) + spent


@dataclass
class Run:
    """One miss being served: the task, the backend holding the rollout's sandbox, the sandbox."""

    task: Task
    backend: SandboxBackend
    policy: TaskPolicy
    rollout: Rollout
    row: Sandbox
    sandbox: SandboxHandle
    phases: Phases
    restore_ms: float | None = None  # set when it was forked from a snapshot on the critical path
    diverged: str = ""  # why the sandbox does not reach the recorded state (then nothing is recorded)
    how: str = MaterializationStat.How.OWN  # how it got to the history's state (counted per task)
    marked: bool = False  # marked `executing` already (rollout_sandbox's `mark`)


# The rollout's own sandbox when it holds the whole history already and no work after the previous
# answer holds it (reserved.py), marked `executing` (committed before the call runs, as misses.py's
# mark) in the statement that reads the miss's task (cache.selectors.task_for_miss): a rollout whose
# last call ran in it, the usual miss, takes one statement for its task, its sandbox and the mark.
# Where it finds none, the miss takes the long way.
_OWN_MARKED_SQL = f"""UPDATE sandboxes_sandbox SET executing = true, lease_expires_at = %s
WHERE rollout_id = %s AND state = 'leased' AND NOT executing AND applied = %s AND {FREE}"""


def own_marked(rollout_pk: int, applied: int) -> Rider:
    """The write that marks the rollout's own sandbox `executing` where it has applied `applied`
    calls of the history and is free (rollout_sandbox's `marked`), to ride on the task's read."""
    key = reservation_key(rollout_pk)
    return Rider(Sandbox, _OWN_MARKED_SQL, (idle_deadline(busy=True), rollout_pk, applied, key, key))


def unmarked(row: Sandbox) -> None:
    """The sandbox's mark given back, its state as the row says: the miss stopped before its call
    ran (its task refused it), or the rollout left the shared graph keeping its sandbox."""
    Sandbox.objects.filter(pk=row.pk).update(executing=False, lease_expires_at=idle_deadline())


def rollout_sandbox(
    task, backend, rollout, context: CallContext, answer, phases: Phases, *, marked: Sandbox | None = None
) -> Run:
    """The rollout's sandbox brought up to date with its history (everything before the call) and
    checked against the state its history's node recorded: its own sandbox, else a materialized
    one (a pre-fork, a fork, a ready root), else, when that diverged, a fresh one replayed from the
    root. A sandbox whose replay failed midway is retired: its state is unknown. `marked`: its own
    sandbox, marked `executing` already and holding the history (own_marked): used as it is."""
    policy = TaskPolicy.from_json(task.tools)
    if marked is not None:
        run = _own(task, policy, rollout, marked, phases)
        if run is not None:
            run.marked = True
            return _counted(run, answer, context)
    waited_ms = wait_unreserved(rollout.pk, timeout_s=RESERVED_WAIT_S)  # work after the previous answer
    row = Sandbox.objects.filter(rollout=rollout, state=Sandbox.State.LEASED).first()
    if waited_ms:
        phases.ms["background_wait"] = waited_ms
    if row is not None and waited_ms is None:
        retire(row, f"work after an answer (a snapshot, a catch-up) still held it after {RESERVED_WAIT_S:.0f} s")
        row = None
    if row is not None and row.executing:
        retire(row, "cut off mid-call (the server stopped): it may be ahead of the rollout's history")
        row = None
    try:
        run = _own(task, policy, rollout, row, phases) if row is not None else None
        if run is not None:
            pending = [c for c in context.history[row.applied :] if policy.for_tool(c.tool).mutates_state]
            if not pending or _caught_up(run, pending, context, _reached(answer, context)):
                return _counted(run, answer, context)
        else:
            with phases.timed("materialize"):
                run = _materialize(task, backend, policy, rollout, answer, phases)
            replay = _replay_calls(answer, run)
            if not (replay or run.row.pool == Sandbox.Pool.FORK) or _caught_up(
                run, replay, context, _reached(answer, context)
            ):
                return _counted(run, answer, context)
        return _counted(_from_root(task, backend, policy, rollout, context, answer, phases), answer, context)
    except SandboxError as exc:
        raise as_application_error(exc) from None


def _counted(run: Run, answer, context: CallContext) -> Run:
    """Counts how the miss got its sandbox, and whether the state it reached had live processes
    (MaterializationStat; the dashboard shows them)."""
    node = answer.match.node
    processes = bool(node is not None and answer.match.matched == len(context.history) and node.processes)
    how = MaterializationStat.How.UNCACHED if run.diverged else run.how
    materialized_add(task_id=run.task.pk, how=how, processes=processes)
    return run


def catch_up_after_answer(task_id: str, rollout: Rollout, history: tuple[ToolCall, ...], node_id: int) -> None:
    """After a state-changing hit of a rollout that has a sandbox: the sandbox replays what it
    lacks while the policy thinks, so that the rollout's next miss finds it up to date. It runs in
    a thread of this process with the sandbox reserved (reserved.py), from before the answer
    leaves; if the reservation is held already (a snapshot still being taken), the next miss
    catches up itself, as it would anyway."""
    run_reserved(rollout.pk, lambda: _catch_up(task_id, rollout, history, node_id), name="catch-up")


def _catch_up(task_id: str, rollout: Rollout, history: tuple[ToolCall, ...], node_id: int) -> None:
    """Replays and verifies as a miss would (`history` ends with the hit's call, `node_id` its
    node). The sandbox is marked `executing` meanwhile: a server that dies mid-replay leaves it
    ahead of `applied`, and the next miss retires it."""
    row = Sandbox.objects.filter(rollout=rollout, state=Sandbox.State.LEASED, executing=False).first()
    task = Task.objects.filter(pk=task_id).first()
    if row is None or task is None:
        return
    policy = TaskPolicy.from_json(task.tools)
    pending = [c for c in history[row.applied :] if policy.for_tool(c.tool).mutates_state]
    if not pending:
        return
    if not Sandbox.objects.filter(pk=row.pk, state=Sandbox.State.LEASED, executing=False).update(executing=True):
        return
    # The context's call is not part of the state: replay_file_times reads the history's writes.
    context = CallContext(history, history[-1], rollout.rollout_id, 0, None)
    fork = _fork_to_catch_up(task_id, history, row.applied, node_id)
    if fork is not None and _forked(task, policy, rollout, row, context, fork, node_id):
        return
    run = _own(task, policy, rollout, row, Phases())
    if run is not None and _caught_up(run, pending, context, node_id):
        Sandbox.objects.filter(pk=row.pk).update(executing=False)


def _fork_to_catch_up(task_id: str, history: tuple[ToolCall, ...], applied: int, node_id: int) -> Match | None:
    """The snapshot to fork instead of replaying what the sandbox lacks, when that costs less
    (tcg.catch_up): a rollout that hit a long call (a build, a download) another rollout ran. That
    rollout's snapshot of the call's state may be being taken still: it is waited for, up to what
    replaying would cost more than restoring it."""
    plan = history_catch_up(task_id=task_id, history=history, applied=applied)
    if plan is None or plan.fork is not None:
        return plan.fork if plan is not None else None
    spare_ms = plan.replay_ms - _restore_ms(task_id)
    if spare_ms <= 0 or wait_snapshot(node_id, timeout_s=spare_ms / 1000) in (None, 0.0):
        return None
    plan = history_catch_up(task_id=task_id, history=history, applied=applied)
    return plan.fork if plan is not None else None


def resume_snapshotted(task_id: str, context: CallContext, answer, phases: Phases):
    """For a rollout without a sandbox: when the state its history reaches is being snapshotted
    (the rollout that ran its last call was answered a moment ago) and replaying up to it from the
    snapshot offered costs more than restoring it would, wait for that snapshot (up to the
    difference) and offer it instead. Returns the answer to materialize from (its lease the
    caller's to release; a replaced answer's lease is released here)."""
    node, resume = answer.match.node, answer.match.resume
    if node is None or (resume is not None and resume.node_id == node.node_id):
        return answer
    spare_ms = node.cum_exec_ms - (resume.cum_exec_ms if resume else 0.0) - _restore_ms(task_id)
    if spare_ms <= 0 or not snapshot_pending(node.node_id):
        return answer
    with phases.timed("snapshot_wait"):
        wait_snapshot(node.node_id, timeout_s=spare_ms / 1000)
        again = tcg_lookup(task_id=task_id, context=context, count=False, resume=True)
    if not isinstance(again, LookupMiss) or again.match.resume is None or again.match.resume.node_id != node.node_id:
        if isinstance(again, LookupMiss) and again.lease_id:
            lease_release(lease_id=again.lease_id)
        return answer
    if answer.lease_id:
        lease_release(lease_id=answer.lease_id)
    return again


def _restore_ms(task_id: str) -> float:
    """What restoring a snapshot of the task's backend costs (a moving average)."""
    return backend_costs(task_handle(task_id=task_id, cached=True).backend).restore_ms


def _forked(task, policy, rollout, row: Sandbox, context: CallContext, fork: Match, node_id: int) -> bool:
    """The rollout's sandbox replaced by a fork of `fork.resume`, caught up and verified as a miss's
    would be (marked `executing` meanwhile). False, the sandbox untouched, if the snapshot is
    gone; once the old sandbox is stopped, a failure leaves the rollout without one: its next miss
    materializes a sandbox as a rollout without one does."""
    lease_id = lease_grant(snapshot_id=fork.resume.snapshot_id, rollout_id=rollout.rollout_id)
    if lease_id is None:
        return False
    restore_ms = None
    try:
        sandbox_stop(sandbox_id=row.pk)
        answer = LookupMiss(
            match=fork,
            lease_id=lease_id,
            full_replay=tuple(call for call in context.history if policy.for_tool(call.tool).mutates_state),
            anchor_key="",
            call_digest="",
            seen=False,
        )
        run = _materialize(task, sandbox_backend(row), policy, rollout, answer, Phases())
        restore_ms = run.restore_ms
        Sandbox.objects.filter(pk=run.row.pk).update(executing=True)
        if _caught_up(run, _replay_calls(answer, run), context, node_id):
            Sandbox.objects.filter(pk=run.row.pk).update(executing=False)
    finally:
        lease_release(lease_id=lease_id, restore_ms=restore_ms)
    return True


def _reached(answer, context: CallContext) -> int | None:
    """The node whose state the whole history reaches (its last call's), if the graph has it."""
    node = answer.match.node
    return node.node_id if node is not None and answer.match.matched == len(context.history) else None


def _caught_up(run: Run, calls, context: CallContext, reached: int | None) -> bool:
    """Replay `calls` and verify; False when the sandbox diverged or died (it is retired then).
    Another failure midway retires it and raises."""
    try:
        if _replay_verified(run, calls, context, reached):
            return True
        retire(run.row, f"diverged from its history: {run.diverged}")
    except SandboxGone as exc:
        retire(run.row, exc.message)
    except SandboxError as exc:
        retire(run.row, f"its replay failed midway: {exc.code}: {exc.message}")
        raise
    return False


def _run(task, policy, rollout, row: Sandbox, phases: Phases, restore_ms: float | None = None) -> Run:
    sandbox = sandbox_handle(row)
    return Run(task, sandbox_backend(row), policy, rollout, row, sandbox, phases, restore_ms)


def _own(task, policy, rollout, row: Sandbox, phases: Phases) -> Run | None:
    """The rollout's own sandbox; None when it is gone (retired: nothing ran in it since)."""
    try:
        return _run(task, policy, rollout, row, phases)
    except SandboxGone as exc:
        retire(row, exc.message)
        return None


def _from_root(task, backend, policy, rollout, context: CallContext, answer, phases: Phases) -> Run:
    """A fresh sandbox and a replay of the whole history, after another sandbox diverged. If this
    one does not reach the recorded state either, `diverged` says so and the call is answered
    uncached."""
    with phases.timed("materialize"):
        row = _start_leased(task, backend, rollout, None)
    if row is None:
        raise SandboxGone("could not start a fresh sandbox")
    run = _run(task, policy, rollout, row, phases)
    run.how = MaterializationStat.How.REBUILT
    if answer.full_replay:
        try:
            _replay_verified(run, answer.full_replay, context, _reached(answer, context))
        except SandboxError:
            retire(row, "its replay from the root failed midway")
            raise
    return run


def _replay_calls(answer, run: Run) -> tuple[ToolCall, ...]:
    """What a materialized sandbox replays: the calls after its snapshot, or the whole history."""
    resume = answer.match.resume
    if run.row.pool == Sandbox.Pool.FORK and resume is not None and run.row.snapshot_id == resume.snapshot_id:
        return answer.match.replay
    return answer.full_replay


def _materialize(task, backend, policy, rollout, answer, phases: Phases) -> Run:
    resume = answer.match.resume
    snapshot = None
    if resume is not None:
        snapshot = Snapshot.objects.filter(
            pk=resume.snapshot_id, owner=Snapshot.Owner.SERVICE, backend=backend.name
        ).first()
    if snapshot is not None and resume.processes and not snapshot.keeps_processes:
        snapshot = None  # its files alone are not the state (tcg.NodeRef.resumable): a root replays it
    if snapshot is not None:
        row, restore_ms = sandbox_acquire(task_id=task.pk, snapshot_id=snapshot.pk, rollout_pk=rollout.pk), None
        how = MaterializationStat.How.PREFORK
        if row is None:
            row = _start_leased(task, backend, rollout, snapshot)
            restore_ms = row.start_ms if row is not None else None
            how = MaterializationStat.How.FORK
        if row is not None:
            prefork_if_room(task_id=task.pk, snapshot_id=snapshot.pk)  # keep a fork of a hot snapshot ready
            run = _run(task, policy, rollout, row, phases, restore_ms)
            run.how = MaterializationStat.How.CHECKPOINT if snapshot.keeps_processes else how
            return run
    row = sandbox_acquire(task_id=task.pk, snapshot_id=None, rollout_pk=rollout.pk) or _start_leased(
        task, backend, rollout, None
    )
    run = _run(task, policy, rollout, row, phases)
    run.how = MaterializationStat.How.ROOT
    return run


def _start_leased(task, backend, rollout, snapshot) -> Sandbox | None:
    """Start (or fork) a sandbox on the critical path, leased to the rollout from the outset."""
    engine = snapshot.engine if snapshot is not None else engines_for(backend.name, 1)[0]
    row = sandbox_row(
        task=task,
        backend=backend.name,
        engine=engine,
        rollout=rollout,
        state=Sandbox.State.WARMING,
        pool=Sandbox.Pool.FORK if snapshot else Sandbox.Pool.ROOT,
        snapshot=snapshot,
    )
    started = time.perf_counter()
    try:
        sandbox = sandbox_launch(row, task.env, snapshot=snapshot)
    except SnapshotMissing:
        set_state(row, Sandbox.State.FAILED, error="snapshot missing")
        return None
    except SandboxError as exc:
        set_state(row, Sandbox.State.FAILED, error=f"{exc.code}: {exc.message}")
        raise
    remember(sandbox_backend(row), sandbox)
    set_state(
        row,
        Sandbox.State.LEASED,
        ref=sandbox.sandbox_id,
        ready_at=timezone.now(),
        start_ms=(time.perf_counter() - started) * 1000,
        lease_expires_at=idle_deadline(),
    )
    metrics.sandbox_started(backend=backend.name, forked=snapshot is not None, path="critical", ms=row.start_ms)
    return row


def _replay_verified(run: Run, calls, context: CallContext, reached: int | None) -> bool:
    """Re-execute state-changing calls whose results are known, to rebuild the state, and compare
    the sandbox with the fingerprint the history's last node (`reached`) recorded. False (and
    `diverged` set, a divergence recorded) when a replayed call timed out or the state differs."""
    history = context.history
    with run.phases.timed("replay"):  # a failure midway raises: the callers retire the sandbox

        def spent(call: ToolCall, ms: float) -> None:
            replay_add(task_id=run.task.pk, epoch=context.epoch, tool=call.tool, ms=ms)

        if not replay_restoring_times(
            run.sandbox, calls, replay_file_times(task_id=run.task.pk, context=context, calls=calls), spent=spent
        ):
            run.diverged = "a replayed call timed out"
    if not run.diverged:
        Sandbox.objects.filter(pk=run.row.pk).update(applied=len(history))
        run.row.applied = len(history)
    if reached is None:
        return not run.diverged  # no node holds the whole history's state: nothing to compare with
    # A bare fork of an exact snapshot must be an exact copy; a replay, which wrote back each call's
    # live times, must have their order (StateDigest.order; the shape for a node recorded without
    # it), and so must a fork of a snapshot taken of a replay (Snapshot.exact).
    with run.phases.timed("verify"):
        full, order, shape, tool = Node.objects.filter(pk=reached).values_list(
            "state_fingerprint", "state_order", "state_shape", "tool"
        ).first() or ("", "", "", "")
        bare = not calls and Snapshot.objects.filter(pk=run.row.snapshot_id, exact=True).exists()
        column, expected = (
            ("state_fingerprint", full) if bare else ("state_order", order) if order else ("state_shape", shape)
        )
        state = run.sandbox.state_fingerprint() if expected and not run.diverged else None
    actual = getattr(state, _DIGESTS[column]) if state else None
    if actual is not None and actual != expected:
        run.diverged = f"its state ({column}) {actual[:12]} is not node {reached}'s {expected[:12]}"
    if run.diverged:
        divergence_record(
            task_id=run.task.pk,
            node_id=reached,
            tool=tool,
            kind=Divergence.Kind.STATE,
            expected={"fingerprint": expected},
            observed={"fingerprint": actual, "sandbox": run.row.pool, "why": run.diverged},
            rollout_id=run.rollout.rollout_id,
        )
    return not run.diverged


_DIGESTS = {"state_fingerprint": "full", "state_order": "order", "state_shape": "shape"}


def replay_restoring_times(
    sandbox: SandboxHandle, calls, times, ran=lambda call, result: not result.get("timed_out"), spent=None
) -> bool:
    """Execute `calls` again, each followed by the file times its live run left (`times`, from
    cache.services.replay_file_times), up to the first call whose times were not kept: from there
    on the replay's own times stand (later than every restored one, so the order between calls
    stays the live one). False if a call did not run as recorded (`ran`: it timed out; the
    replay stops there). `spent(call, ms)` is told each call's time: a replay is work the cache
    did not save."""
    restoring = True
    for call, left in zip(calls, times):
        started = time.perf_counter()
        result = sandbox.execute(call.tool, call.args)
        if spent is not None:
            spent(call, (time.perf_counter() - started) * 1000)
        if not ran(call, result):
            return False
        restoring = restoring and left is not None
        if restoring:
            sandbox.restore_file_times(left)
    return True


def retire(row: Sandbox, reason: str) -> None:
    """Take the sandbox away from the rollout; its next call materializes a new one."""
    set_state(row, Sandbox.State.FAILED, rollout=None, error=reason)
    forget(row.backend, row.ref)
    try:
        sandbox_backend(row).remove_sandbox(row.ref)
    except SandboxError:  # the orphan reaper removes it later (its engine down: with it)
        pass
