"""Client mode: a rollout's tool calls, answered by the cache or run in the trainer's sandboxes."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

from .client import TaskSpec, TVCacheClient
from .environment import ToolExecutionEnvironment
from .errors import TVCacheError
from .results import Call, LookupResult, RecordResult, ToolResult, inexact_json
from .snapshots import SnapshotStore

logger = logging.getLogger(__name__)

EnvFactory = Callable[[], ToolExecutionEnvironment]

# Single flight: how soon a rollout looks up again a call another rollout is executing, doubling
# up to the cap (a call that runs for seconds costs a few lookups a second, a quick one ~10 ms).
FLIGHT_POLL_FIRST_S = 0.01
FLIGHT_POLL_MAX_S = 0.1
# A record carries the file times of at most this many changed paths and path characters: the
# service's limits (cache/inputs.py, MAX_FILE_TIMES and MAX_FILE_TIMES_PATHS; a record over them is
# refused). A call that changed more records none, and replays restore no times from it on.
MAX_FILE_TIMES = 20_000
MAX_FILE_TIMES_PATHS = 4 << 20
# (task, tool) pairs whose uncacheable results were logged: once per process is enough to say why.
_warned_uncacheable: set[tuple[str, str]] = set()


@dataclass(frozen=True, slots=True)
class _Background:
    """A miss's record, snapshot and lease release, going on in a thread of its own.

    Its events are set as it gets there, and all of them once it is over (a failure included,
    which `done` then carries), so that nothing waits on them for ever.
    """

    call: Call
    recorded: threading.Event = field(default_factory=threading.Event)  # the record is done, or given up
    # It no longer uses the environment: the snapshot is frozen (env.fork() returned), or none
    # was wanted. Its registration and the lease release may still be on their way.
    env_free: threading.Event = field(default_factory=threading.Event)
    # The record and the snapshot's registration are done: the next miss's record may be sent.
    registered: threading.Event = field(default_factory=threading.Event)
    done: Future[None] = field(default_factory=Future)  # all of it; carries what it raised

    def run(self, work: Callable[[], Any]) -> None:
        """Run `work` in a thread of its own."""

        def target() -> None:
            try:
                work()
            except BaseException as exc:
                self.done.set_exception(exc)
            else:
                self.done.set_result(None)
            finally:  # after `done`: a waiter that wakes finds what it raised
                for event in (self.recorded, self.env_free, self.registered):
                    event.set()

        # Not a daemon: an interpreter that exits without close() still sends the last record.
        threading.Thread(target=target, name="tvclient-record").start()


@dataclass(frozen=True, slots=True)
class _Executed:
    """A call that ran in the rollout's environment, to be recorded."""

    history: list[Call]  # the calls before it
    call: Call
    result: ToolResult
    mutated: bool | None  # whether the env saw it change anything (None: unknown)
    exec_ms: float
    file_times: Mapping[str, int] | None = None  # what it changed (ToolExecutionEnvironment.file_times)
    trace: Mapping[str, Any] | None = None  # the call's fields for the tree export (ToolCallExecutor._trace)


def _elapsed_ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000.0


_J = TypeVar("_J")


def _json_copy(value: _J) -> _J:
    # The caller may reuse its dict, and calls must compare equal to the service's JSON echo
    # of them (a tuple argument comes back as a list).
    return cast(_J, json.loads(json.dumps(value)))


def _write_positions(history: list[Call], writes: tuple[Call, ...]) -> list[int]:
    """Positions in `history` of the service's state-changing calls, a subsequence of it.

    Equal calls share a tool and so a mutates_state declaration: the first occurrence after
    the previous write is the right one.
    """
    positions: list[int] = []
    for write in writes:
        start = positions[-1] + 1 if positions else 0
        try:
            positions.append(history.index(write, start))
        except ValueError:
            raise TVCacheError(200, "bad_response", f"replay call {write!r} is not in the rollout's history") from None
    return positions


class ReplayFailed(RuntimeError):
    """A replayed call did not reproduce its recorded run (it timed out or raised): the
    environment is in no state the history describes. Not the caller's call failing: an
    integration must not show it to the model as that call's answer."""


def _timed_out(result: object) -> bool:
    return isinstance(result, dict) and result.get("timed_out") is True


def _restores_file_times(env: ToolExecutionEnvironment) -> bool:
    return type(env).restore_file_times is not ToolExecutionEnvironment.restore_file_times


def _forks_lose_processes(env: ToolExecutionEnvironment) -> bool:
    """A fork of the environment now would come up without processes that run in it (it reports
    some, and its forks copy files only): no snapshot of this state is taken."""
    if env.keeps_processes:
        return False
    try:
        live = env.live_processes()
    except Exception as exc:  # noqa: BLE001 - a snapshot not taken only costs its reuse
        logger.warning("could not list the environment's processes: %s", exc)
        return True
    return bool(live)


class ToolCallExecutor:
    """Runs one rollout's tool calls through the cache, in environments the trainer owns.

    Each call takes the steps of the rollout protocol the service itself runs for tool-server
    mode and the verl-tool proxy (the service's cache/tcg/rollout.py; docs/design/architecture.md),
    on the trainer's side: look up (the lookup takes the single-flight claim in the same
    request); serve a hit; wait and look up again while another rollout executes the call;
    else catch up, execute, apply the known-state rule, and record.

    Create one per rollout and call `execute` once per tool call, in order. A hit runs
    nothing. The first miss materialises the rollout's own environment, forked from a
    snapshot this process holds when the service offers one, else started fresh, and replays
    the state-changing calls it lacks; later misses reuse it. Every executed call, replays
    included, is sent to the service to be recorded.

    A miss returns as soon as its call has run: reading what it changed (`file_times`), its
    record, the snapshot the service may ask for, the snapshot's registration and the release
    of its lease go on in a thread of their own, while the policy generates the next call. A
    hit waits for none of it. The next call that uses the environment (a miss, an audit)
    waits only until that work no longer uses it: the snapshot is frozen (`env.fork()`
    returned, so it holds the state right after the call), or the record answered that none
    is wanted. The registration and the lease release go on meanwhile, so the work of several
    misses may overlap; each miss's record is sent after the previous miss's record and
    snapshot registration (a node's parent is recorded first, and the service decides the
    next snapshot knowing the last). `env`, `flush()` and `close()` wait for all of it. If
    the service rejects a record or a snapshot's registration, or cannot be reached, that is
    logged and counted in `record_failures` and the call's result stands: the cache only
    lacks that node or snapshot. Any other error there (the environment failing to fork,
    say) is raised by the next of those waits that finds it done.

    Counters: `hits`, `misses`, `executed` (looked-up calls run in an environment),
    `replayed` (calls run again only to rebuild state), `waited` (calls that waited for
    another rollout executing them) and `background_wait_ms` (time the rollout waited for a
    miss's background work that the policy's thinking did not cover: mostly snapshots being
    frozen).

    Single flight (with a `rollout_id`, unless `single_flight=False`): a miss claims the call,
    and a rollout that misses on a call another rollout is executing in the same state waits
    for its record and takes the hit instead of executing it too. Rollouts of one task start
    alike, so without it their first calls run once per rollout.

    Determinism audit: the service marks a sampled fraction of hits (the task's `audit_rate`)
    for audit. The executor re-executes such a hit in its own environment only where that is
    exact: the hit is read-only (`mutates: false`) and the environment is open at the current
    history (no state-changing hit pending replay), so it is at the hit's parent state and the
    call leaves it there. It reports the result to the service, which compares it with the
    node's and stops serving a node that differs. The rollout still gets the cached result.
    A state-changing hit, or one with no environment at its state, is not audited here (it
    would need a fork at the parent state): `audits_skipped` counts them. An audited call that
    changed the environment, or may have (not observed and not declared read-only), or that
    failed or timed out, drops the environment: the next miss rebuilds it. Counters: `audited`,
    `divergent` (audits the service found different), `audits_skipped`.

    Known-state rule: a call whose environment raised or answered `timed_out`, and a replay
    that failed, leave the environment in a state no history describes. The rollout then
    leaves the shared graph (`detached`): its later calls run in its own environment as it is,
    with no lookup and no record, so nothing it sees is filed under a state it may not have
    reached, and no snapshot is taken of it. A failure to open the environment (a fork or a
    start) runs no call, so the rollout stays on the graph and the next miss tries again.

    Processes (environments that implement `live_processes`): a state in which the environment
    reports processes running is never snapshotted unless its forks keep them
    (`keeps_processes`), so no rollout forks a copy of its files alone for it: a rollout that
    needs it replays the calls that started them from an earlier snapshot or a fresh start. An
    environment that cannot tell is trusted as before.

    File times (environments that implement `file_times` and `restore_file_times`): a call
    that ran live is recorded with the modification times of what it changed, read from the
    environment in the background before the record. Before a replay the executor asks the
    service for the times each replayed call left when it was recorded (POST .../file-times)
    and writes them back after it, so that a replayed sandbox carries the live run's times
    (make and Python's whole-second bytecode check read them). A failure to get them fails the
    miss like a failed fork: the replay does not run with its own times.

    Results that are not exact JSON (`inexact_json`: a tuple, a set, an int key, a str subclass,
    NaN...) would come back from the cache as something else, so they are never recorded: the
    call's live result is returned as it is, `uncacheable` counts it, a warning says why (once
    per task and tool in a process), and if the call may have changed the state the rollout detaches. A call whose
    arguments are not exact JSON runs the same way, uncached.

    Outages: tvcache's own failures never reach the caller. A request the service cannot answer
    is retried by the client (tvclient.retry); what still fails, or any error the service
    answers a lookup with, makes the rollout go on uncached (`offline`, and `detached`): its
    environment catches up on the state-changing calls it has not run (all of them when it has
    none yet: a rollout started while the service is down runs uncached from its start), and
    every later call runs there, with nothing recorded. One warning per rollout says so. New
    rollouts use the service again once it answers.

    `task`: the task's spec, registered (`TVCacheClient.ensure_task`) before the first lookup.

    `snapshots` should be one store shared by all executors of the trainer process; without
    it the executor keeps a private store and stops its snapshots on close().
    """

    def __init__(
        self,
        client: TVCacheClient,
        task_id: str,
        env_factory: EnvFactory,
        *,
        rollout_id: str | None = None,
        epoch: int | None = None,
        snapshots: SnapshotStore | None = None,
        single_flight: bool = True,
        task: TaskSpec | None = None,
        trajectory_ref: str | None = None,
    ) -> None:
        self._client = client
        self.task_id = task_id
        self._task = task
        self._env_factory = env_factory
        self.rollout_id = rollout_id
        self.epoch = epoch
        self._claim = single_flight and rollout_id is not None
        self._owns_snapshots = snapshots is None
        self.snapshots = SnapshotStore() if snapshots is None else snapshots
        self._history: list[Call] = []
        self._env: ToolExecutionEnvironment | None = None
        # History positions of state-changing hits that the rollout's own env has not run.
        self._pending: list[int] = []
        self.hits = 0
        self.misses = 0
        self.executed = 0
        self.replayed = 0
        self.waited = 0
        self.record_failures = 0
        self.background_wait_ms = 0.0
        self.audited = 0
        self.divergent = 0
        self.audits_skipped = 0
        self.uncacheable = 0
        self.detached = False
        self.offline = False  # the service failed: the rollout runs uncached (class docstring)
        self.branch_of: tuple[str | None, int] | None = None  # (rollout id, step) this one branched from
        # For the rollout tree export (docs/design/tree-search.md): the trainer's trajectory,
        # what a branch shares of its origin's tokens, the calls so far, the current call's fields.
        self.trajectory_ref = trajectory_ref
        self._branch_tokens: Mapping[str, Any] | None = None
        self._calls = 0
        self._trace: dict[str, Any] | None = None
        # Misses' background work, oldest first: only the last one may still use the environment.
        self._background: list[_Background] = []
        self._failures = threading.Lock()  # background threads count record_failures too

    @property
    def history(self) -> tuple[Call, ...]:
        """The history the executor sends: the rollout's calls, less the hits that the service
        says left the state as it was."""
        return tuple(self._history)

    def branch(
        self,
        n: int,
        *,
        rollout_ids: Sequence[str] | None = None,
        tokens: Mapping[str, Sequence[int]] | None = None,
        trajectory_refs: Sequence[str] | None = None,
    ) -> list[ToolCallExecutor]:
        """`n` executors that continue this rollout after its last call, for tree search.

        Each starts with this rollout's history, the same client, task, environment factory
        and snapshot store, and a rollout id of its own (`rollout_ids`, default
        `<rollout_id>.<step>.<k>`). Their calls are looked up after that history, and the
        first one that misses materialises the branch's environment exactly as a miss does:
        a fork of the nearest snapshot this process holds, else a fresh environment, then a
        replay of the calls past it. This rollout's background work (records, snapshots) is
        waited for first, so that the branches find them. A detached rollout (its state
        unknown, or the service down: `offline`) cannot be branched (RuntimeError).

        For the rollout tree export, each branch's calls say where it started; `tokens`
        (`{"prompt": [0, n]}`) is what every branch shares of this trajectory's tokens, and
        `trajectory_refs` names each branch's trajectory.
        """
        if n < 1:
            raise ValueError("n must be at least 1")
        if self.detached:
            raise RuntimeError("the rollout left the shared graph (its state is unknown): it cannot be branched")
        if rollout_ids is not None and (len(rollout_ids) != n or len(set(rollout_ids)) != n):
            raise ValueError(f"rollout_ids must be {n} distinct ids")
        if trajectory_refs is not None and len(trajectory_refs) != n:
            raise ValueError(f"trajectory_refs must be {n} references")
        self.flush()
        stem = f"{self.rollout_id or 'rollout'}.{len(self._history)}"
        ids = list(rollout_ids) if rollout_ids is not None else [f"{stem}.{uuid.uuid4().hex[:8]}" for _ in range(n)]
        branches = []
        for i, rollout_id in enumerate(ids):
            branch = ToolCallExecutor(
                self._client,
                self.task_id,
                self._env_factory,
                rollout_id=rollout_id,
                epoch=self.epoch,
                snapshots=self.snapshots,
                single_flight=self._claim,
                task=self._task,
                trajectory_ref=None if trajectory_refs is None else trajectory_refs[i],
            )
            branch._history = list(self._history)
            branch._branch_tokens = tokens
            branch._owns_snapshots = False  # the store is this rollout's to close
            branch.branch_of = (self.rollout_id, len(self._history))
            branches.append(branch)
        return branches

    @property
    def env(self) -> ToolExecutionEnvironment | None:
        """The rollout's own environment, once a miss has materialised it.

        Waits for the misses' background work first, which may still be forking it.
        """
        self.flush()
        return self._env

    def execute(self, call: Call, *, tokens: Mapping[str, Sequence[int]] | None = None) -> ToolResult:
        """Run the rollout's next call (see the class docstring). `tokens`: the call's token spans
        in the trajectory, `{"prompt": [start, end], "completion": [start, end]}`, for the
        rollout tree export; they change nothing else."""
        self._trace = self._trace_of(tokens)
        self._calls += 1
        if self.detached:
            return self._execute_detached(call)
        why = inexact_json(call, "the call")
        if why is not None:
            return self._execute_uncacheable_call(call, why)
        call = _json_copy(call)
        try:
            return self._execute_cached(call)
        except TVCacheError as exc:
            self._go_offline(exc)
            return self._execute_detached(call)

    def _trace_of(self, tokens: Mapping[str, Sequence[int]] | None) -> dict[str, Any] | None:
        """The call's fields for the tree export (cache.tcg.records.Trace on the service's side)."""
        if self.rollout_id is None:
            return None
        trace: dict[str, Any] = {"seq": self._calls}
        if self.trajectory_ref is not None:
            trace["trajectory_ref"] = self.trajectory_ref
        if tokens is not None:
            trace["tokens"] = {name: list(span) for name, span in tokens.items()}
        if self.branch_of is not None and self.branch_of[0] is not None:
            origin = {"rollout": self.branch_of[0], "step": self.branch_of[1]}
            if self._branch_tokens is not None:
                origin["tokens"] = {name: list(span) for name, span in self._branch_tokens.items()}
            trace["branch_of"] = origin
        return trace

    def _execute_cached(self, call: Call) -> ToolResult:
        if self._task is not None:
            self._client.ensure_task(self.task_id, self._task)
        background = self._background[-1] if self._background else None
        if background is not None and background.call == call:
            # The rollout repeats the call it has just missed: once that is recorded, the
            # lookup hits rather than claiming the call again and executing it a second time.
            started = time.perf_counter()
            background.recorded.wait()
            self.background_wait_ms += _elapsed_ms(started)
        lookup = self._lookup(call)
        if lookup.hit:
            self._note_hit(call, lookup.mutates)
            if lookup.audit:
                self._audit(call, lookup)
            return cast(ToolResult, lookup.result)  # a hit always carries its result
        self.misses += 1
        result, changed = self._resolve_miss(call, lookup)
        if changed is not False:  # observed to change nothing: the state is as it was
            self._history.append(call)
        return result

    def _lookup(self, call: Call) -> LookupResult:
        """The lookup's answer once no other rollout is executing the call in this state."""
        delay, waiting = FLIGHT_POLL_FIRST_S, False
        while True:
            lookup = self._client.lookup(
                self.task_id,
                self._history,
                call,
                rollout_id=self.rollout_id,
                epoch=self.epoch,
                claim=self._claim,
                # An open environment replays what it missed: no snapshot (nor lease) needed.
                resume=self._env is None,
                trace=self._trace,
            )
            if lookup.claim != "in_flight":
                return lookup
            if not waiting:
                waiting, self.waited = True, self.waited + 1
            time.sleep(delay)
            delay = min(delay * 2, FLIGHT_POLL_MAX_S)

    def flush(self) -> None:
        """Wait for the misses' records, snapshots, registrations and lease releases to be done.

        Raises what that work raised, but for the service errors it logs and counts.
        """
        if not self._background:
            return
        started = time.perf_counter()
        try:
            wait_all([background.done for background in self._background])
        finally:
            self.background_wait_ms += _elapsed_ms(started)
        self._collect()

    def _env_settled(self, *, registered: bool = False) -> None:
        """Wait until the misses' background work no longer uses the environment (the last
        one's snapshot is frozen), or also until the last snapshot is registered, and raise
        what finished work raised, as flush() does."""
        if not self._background:
            return
        started = time.perf_counter()
        try:
            last = self._background[-1]
            (last.registered if registered else last.env_free).wait()
        finally:
            self.background_wait_ms += _elapsed_ms(started)
        self._collect()

    def _collect(self) -> None:
        """Forget the background work that is over; raise the first error it raised."""
        over = [background for background in self._background if background.done.done()]
        self._background = [background for background in self._background if not background.done.done()]
        errors = [error for error in (background.done.exception() for background in over) if error is not None]
        for error in errors[1:]:
            logger.error("background work of a miss failed too", exc_info=error)
        if errors:
            raise errors[0]

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._drop_env()
            if self._owns_snapshots:
                self.snapshots.close()

    def __enter__(self) -> ToolCallExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _note_hit(self, call: Call, mutates: bool) -> None:
        self.hits += 1
        if not mutates:  # the state is as it was: later calls are looked up without this one
            return
        if self._env is not None and self._env.mutates_state(call):
            self._pending.append(len(self._history))
        self._history.append(call)

    def _audit(self, call: Call, lookup: LookupResult) -> None:
        """Re-execute a sampled read-only hit in the environment, if it is at the hit's parent
        state, and report the result (see the class docstring)."""
        if lookup.mutates or self._env is None or self._pending or lookup.node_id is None:
            self.audits_skipped += 1
            return
        self._env_settled()  # the environment may still be forking for the last miss's snapshot
        env = self._env
        try:
            fresh, mutated = env.execute_observed(call)
        except Exception as exc:
            logger.warning("audit of %s failed in the environment: %s", call, exc)
            self._drop_env()  # its state is unknown now
            self.audits_skipped += 1
            return
        timed_out = isinstance(fresh, dict) and fresh.get("timed_out") is True
        if mutated or (mutated is None and env.mutates_state(call)) or timed_out:
            self._drop_env()  # it may have moved past the history
        if timed_out:  # cut short: proves nothing about the tool
            self.audits_skipped += 1
            return
        try:
            divergent = self._client.report_audit(
                self.task_id, lookup.node_id, _json_copy(fresh), rollout_id=self.rollout_id
            )
        except TVCacheError as exc:
            self._count_failure()
            logger.warning("could not report the audit of %s: %s", call, exc)
            return
        self.audited += 1
        self.divergent += int(divergent)

    def _resolve_miss(self, call: Call, lookup: LookupResult) -> tuple[ToolResult, bool | None]:
        restore_ms: float | None = None
        lease_id = lookup.resume.lease_id if lookup.resume is not None else None

        def give_up() -> None:
            if lookup.claim == "granted":  # rollouts waiting on this call execute it now
                self._release_claim(self._history, call)
            if lease_id is not None:
                self._release(lease_id, restore_ms)

        try:
            if self._env is None:
                restore_ms, replay = self._open_env(lookup)
            else:
                replay, self._pending = self._pending, []
            try:  # asked over HTTP while the last miss's snapshot may still be freezing
                times = self._replay_file_times(call, replay)
            except TVCacheError:
                self._pending = replay  # the environment still lacks them: the outage catch-up runs them
                raise
            # The last miss's snapshot is frozen before the environment moves on, and registered
            # before a replay is recorded (the service decides on a snapshot knowing it).
            self._env_settled(registered=bool(replay))
        except TVCacheError:  # no call ran; the environment is as the history says, less `_pending`
            give_up()
            raise
        except BaseException:  # no call ran: the next miss opens an environment again
            self._drop_env()
            give_up()
            raise
        try:
            restoring = True  # up to the first call whose times were not kept: later ones' are
            for position, left in zip(replay, times):  # older than this replay's own writes
                restoring = restoring and left is not None
                self._replay_one(
                    position, lambda: self._run(position, self._history[position], left if restoring else None)
                )
            executed = self._execute(list(self._history), call)
            self.executed += 1
        except BaseException as exc:
            self._detach(f"{type(exc).__name__}: {exc}")
            give_up()
            raise
        if _timed_out(executed.result):
            self._detach("the call timed out")
            give_up()
            return executed.result, executed.mutated
        why = inexact_json(executed.result)
        if why is not None:
            changed = self._env.mutates_state(call) if executed.mutated is None else executed.mutated
            self._uncacheable(call, why, may_have_changed=changed)
            give_up()
            return executed.result, executed.mutated
        # The caller owns the result it gets back; the record sends a copy taken now.
        recorded = replace(executed, result=_json_copy(executed.result))
        claimed, env = lookup.claim == "granted", self._env
        previous = self._background[-1] if self._background else None
        background = _Background(call)
        # Likely to be asked for a snapshot: freeze it before the record rather than after (the
        # freeze itself checks that a fork would keep the environment's processes).
        early = (
            lookup.snapshot_after_ms is not None
            and executed.mutated is not False
            and executed.exec_ms > lookup.snapshot_after_ms
        )
        background.run(
            lambda: self._record_in_background(
                env, recorded, claimed, lease_id, restore_ms, background, previous, early
            )
        )
        self._background.append(background)
        return executed.result, executed.mutated

    def _record_in_background(
        self,
        env: ToolExecutionEnvironment,
        executed: _Executed,
        claimed: bool,
        lease_id: int | str | None,
        restore_ms: float | None,
        background: _Background,
        previous: _Background | None,
        early: bool = False,
    ) -> None:
        frozen: tuple[ToolExecutionEnvironment, float] | None = None
        try:
            try:
                file_times = self._changed_file_times(env, executed)
                if early:  # the next miss need not wait for this record's answer to move the env on
                    frozen = self._freeze_early(env, background.env_free)
                if previous is not None:
                    previous.registered.wait()
                recorded = self._record(replace(executed, file_times=file_times))
            except BaseException as exc:
                if frozen is not None:
                    frozen[0].stop()
                if claimed:  # rollouts waiting on this call execute it now
                    self._release_claim(executed.history, executed.call)
                if not isinstance(exc, TVCacheError):
                    raise
                self._count_failure()
                logger.warning("could not record %s: %s", executed.call, exc)
                background.env_free.set()
                background.registered.set()
                return
            finally:
                background.recorded.set()
            # Recorded: the claim stays, so that rollouts waiting on it take the hit.
            try:
                self._keep_snapshot(env, recorded, background.env_free, frozen)
            except TVCacheError as exc:
                self._count_failure()
                logger.warning("could not register a snapshot after %s: %s", executed.call, exc)
            background.env_free.set()
            background.registered.set()
        finally:
            if lease_id is not None:
                self._release(lease_id, restore_ms)

    def _open_env(self, lookup: LookupResult) -> tuple[float | None, list[int]]:
        """Fork the offered snapshot if this process holds it, else start fresh.

        Returns the fork's restore time (None for a fresh start) and the history positions
        to replay on the new environment.
        """
        positions = _write_positions(self._history, lookup.replay)
        resume = lookup.resume
        snapshot = self.snapshots.get(resume.snapshot_ref) if resume is not None else None
        if resume is None or snapshot is None:
            env = self._env_factory()
            env.start()
            self._env = env
            return None, positions
        started = time.perf_counter()
        self._env = snapshot.fork()
        return _elapsed_ms(started), positions[len(positions) - len(resume.replay) :]

    def _replay_file_times(self, call: Call, positions: list[int]) -> list[Mapping[str, int] | None]:
        """The file times each replayed call (history positions) left when it was recorded, as
        the service kept them (None: not kept); none to ask for when the environment cannot
        write them back."""
        assert self._env is not None
        if not positions or not _restores_file_times(self._env):
            return [None for _ in positions]
        replay = [self._history[position] for position in positions]
        return self._client.replay_file_times(self.task_id, self._history, call, replay)

    @staticmethod
    def _changed_file_times(env: ToolExecutionEnvironment, executed: _Executed) -> Mapping[str, int] | None:
        """What a call that ran live changed, as the environment saw it, if it can be sent."""
        if executed.mutated is False:
            return None
        times = env.file_times()
        if times is None or len(times) > MAX_FILE_TIMES or sum(map(len, times)) > MAX_FILE_TIMES_PATHS:
            return None
        return dict(times)

    def _run(self, position: int, call: Call, file_times: Mapping[str, int] | None) -> None:
        """Execute `call` (which follows history[:position]) in the rollout's env, give what it
        changed the times of its live run (`file_times`; None: leave the replay's own), and
        record it."""
        assert self._env is not None
        executed = self._execute(self._history[:position], call)
        if _timed_out(executed.result):
            raise ReplayFailed(f"the replay of {call.get('tool')!r} timed out")
        if file_times:
            self._env.restore_file_times(file_times)
        if inexact_json(executed.result) is not None:
            return  # recorded before as exact JSON: a replay that answers otherwise is not filed
        try:
            recorded = self._record(replace(executed, file_times=file_times), replay=True)
            self._keep_snapshot(self._env, recorded)
        except TVCacheError as exc:  # the cache lacks this node; the environment is right
            self._count_failure()
            logger.warning("could not record the replay of %s: %s", call, exc)

    def _detach(self, reason: str) -> None:
        """Take the rollout off the shared graph (the known-state rule, class docstring)."""
        logger.info("rollout %s of task %s leaves the shared graph: %s", self.rollout_id, self.task_id, reason)
        self.detached, self._pending = True, []

    def _execute_detached(self, call: Call) -> ToolResult:
        self._env_settled()
        if self._env is None:
            raise ReplayFailed("the rollout left the shared graph and its environment is gone: end the rollout")
        self.executed += 1
        return self._env.execute(call)

    def _go_offline(self, error: TVCacheError) -> None:
        """The service failed this rollout: go on uncached from here (class docstring, outages)."""
        logger.warning(
            "tvcache is unavailable to rollout %s of task %s (%s): it goes on uncached",
            self.rollout_id,
            self.task_id,
            error,
        )
        self.offline = True
        pending = self._pending
        self._detach(f"the service failed: {error}")
        self._catch_up_uncached(pending)

    def _uncacheable(self, call: Call, why: str, *, may_have_changed: bool) -> None:
        self.uncacheable += 1
        tool = str(call.get("tool"))
        if (self.task_id, tool) not in _warned_uncacheable:
            _warned_uncacheable.add((self.task_id, tool))
            logger.warning(
                "%s of task %s ran uncached: %s, which the cache cannot give back as it is", tool, self.task_id, why
            )
        if may_have_changed:
            self._detach(f"{tool} may have changed the state uncached ({why})")

    def _execute_uncacheable_call(self, call: Call, why: str) -> ToolResult:
        """A call whose arguments are not exact JSON: run where the history says, uncached."""
        pending, self._pending = self._pending, []
        self._catch_up_uncached(pending)
        assert self._env is not None
        self.executed += 1
        result, mutated = self._env.execute_observed(call)
        changed = self._env.mutates_state(call) if mutated is None else mutated
        self._uncacheable(call, why, may_have_changed=changed)
        return result

    def _catch_up_uncached(self, pending: list[int]) -> None:
        """Bring the environment to the rollout's history without the service: open one and
        replay every state-changing call if there is none, else replay the `pending` positions."""
        self._env_settled()
        if self._env is None:
            env = self._env_factory()
            env.start()
            self._env = env
            pending = [position for position, call in enumerate(self._history) if env.mutates_state(call)]
        env = self._env
        for position in pending:
            result = self._replay_one(position, lambda: env.execute(self._history[position]))
            if _timed_out(result):
                raise ReplayFailed(f"the replay of {self._history[position].get('tool')!r} timed out")

    def _replay_one(self, position: int, replay: Callable[[], _J]) -> _J:
        """Run `replay` of the history's call at `position`; a call that ran when it was recorded
        and raises now is not the caller's call failing: ReplayFailed says so."""
        try:
            done = replay()
        except ReplayFailed:
            raise
        except Exception as exc:
            raise ReplayFailed(f"the replay of {self._history[position].get('tool')!r} raised {exc!r}") from exc
        self.replayed += 1
        return done

    def _execute(self, history: list[Call], call: Call) -> _Executed:
        assert self._env is not None
        started = time.perf_counter()
        result, mutated = self._env.execute_observed(call)
        return _Executed(history, call, result, mutated, _elapsed_ms(started), trace=self._trace)

    def _record(self, executed: _Executed, replay: bool = False) -> RecordResult:
        return self._client.record(
            self.task_id,
            executed.history,
            executed.call,
            executed.result,
            executed.exec_ms,
            rollout_id=self.rollout_id,
            epoch=self.epoch,
            mutated=executed.mutated,
            file_times=executed.file_times,
            replay=replay,
            trace=None if replay else executed.trace,
        )

    def _keep_snapshot(
        self,
        env: ToolExecutionEnvironment,
        recorded: RecordResult,
        env_free: threading.Event | None = None,
        frozen: tuple[ToolExecutionEnvironment, float] | None = None,
    ) -> None:
        """Take the snapshot the service asks for after a record in `env` (or keep the one
        `frozen` before it, with its create_ms), and drop what it evicted. `env_free` is set as
        soon as `env` may move on."""
        if recorded.snapshot_wanted:
            self._snapshot(env, recorded.node_id, env_free, frozen)
        else:
            if frozen is not None:
                frozen[0].stop()
            if env_free is not None:
                env_free.set()
        self._discard(recorded.evicted)

    @staticmethod
    def _freeze_early(
        env: ToolExecutionEnvironment, env_free: threading.Event
    ) -> tuple[ToolExecutionEnvironment, float] | None:
        """A snapshot of `env` frozen before the record answers whether it is wanted; None if
        freezing failed, or would lose processes running in it (the record's answer then decides,
        as without it)."""
        if _forks_lose_processes(env):
            return None
        started = time.perf_counter()
        try:
            frozen = env.fork()
        except Exception as exc:  # noqa: BLE001 - only a head start is lost
            logger.warning("could not freeze a snapshot ahead of the record: %s", exc)
            return None
        env_free.set()
        return frozen, _elapsed_ms(started)

    def _snapshot(
        self,
        env: ToolExecutionEnvironment,
        node_id: int,
        env_free: threading.Event | None,
        early: tuple[ToolExecutionEnvironment, float] | None = None,
    ) -> None:
        if early is None:
            if _forks_lose_processes(env):  # no fork of it could stand in for this state
                if env_free is not None:
                    env_free.set()
                return
            started = time.perf_counter()
            frozen = env.fork()
            create_ms = _elapsed_ms(started)
        else:
            frozen, create_ms = early
        if env_free is not None:  # frozen: the rollout's next miss may move the environment on
            env_free.set()
        ref = uuid.uuid4().hex
        # Stored before the service can offer the ref, so that another executor of this
        # process that is offered it right away finds it.
        self.snapshots.add(ref, frozen)
        try:
            registration = self._client.register_snapshot(
                self.task_id, node_id, ref, frozen.backend, create_ms=create_ms
            )
        except TVCacheError as exc:
            self.snapshots.discard(ref)
            if exc.code == "snapshot_exists":  # another rollout registered one for this node first
                return
            raise
        except BaseException:
            self.snapshots.discard(ref)
            raise
        self._discard(registration.evicted)

    def _count_failure(self) -> None:
        with self._failures:
            self.record_failures += 1

    def _discard(self, refs: tuple[str, ...]) -> None:
        for ref in refs:
            self.snapshots.discard(ref)

    def _release(self, lease_id: int | str, restore_ms: float | None) -> None:
        try:
            self._client.release_lease(lease_id, restore_ms=restore_ms)
        except TVCacheError as exc:
            # The service reaps expired leases, so a lost release only delays an eviction;
            # it must neither fail the rollout nor mask the call's own error.
            logger.warning("could not release lease %s: %s", lease_id, exc)

    def _release_claim(self, history: list[Call], call: Call) -> None:
        assert self.rollout_id is not None  # only a rollout's lookups claim
        try:
            self._client.release_claim(self.task_id, history, call, rollout_id=self.rollout_id)
        except TVCacheError as exc:  # the claim lapses on its own (TVCACHE_CLAIM_TTL_S)
            logger.warning("could not release the claim on %s: %s", call, exc)

    def _drop_env(self) -> None:
        if self._background:  # never stop an environment while a snapshot of it is being frozen
            self._background[-1].env_free.wait()
        env, self._env, self._pending = self._env, None, []
        if env is not None:
            env.stop()


class AsyncToolCallExecutor:
    """ToolCallExecutor for asyncio trainers.

    Each call runs the synchronous executor in a worker thread (`asyncio.to_thread`): the
    environments block anyway, and one code path keeps both executors alike. Rollouts in
    flight share the loop's default thread pool; size it (`loop.set_default_executor`) to
    their number. A cancelled `execute` still finishes in its thread.
    """

    def __init__(
        self,
        client: TVCacheClient,
        task_id: str,
        env_factory: EnvFactory,
        *,
        rollout_id: str | None = None,
        epoch: int | None = None,
        snapshots: SnapshotStore | None = None,
        single_flight: bool = True,
        task: TaskSpec | None = None,
        trajectory_ref: str | None = None,
    ) -> None:
        self.executor = ToolCallExecutor(
            client,
            task_id,
            env_factory,
            rollout_id=rollout_id,
            epoch=epoch,
            snapshots=snapshots,
            single_flight=single_flight,
            task=task,
            trajectory_ref=trajectory_ref,
        )

    async def execute(self, call: Call, *, tokens: Mapping[str, Sequence[int]] | None = None) -> ToolResult:
        return await asyncio.to_thread(self.executor.execute, call, tokens=tokens)

    async def branch(
        self,
        n: int,
        *,
        rollout_ids: Sequence[str] | None = None,
        tokens: Mapping[str, Sequence[int]] | None = None,
        trajectory_refs: Sequence[str] | None = None,
    ) -> list[AsyncToolCallExecutor]:
        """ToolCallExecutor.branch for asyncio trainers."""
        branches = await asyncio.to_thread(
            self.executor.branch, n, rollout_ids=rollout_ids, tokens=tokens, trajectory_refs=trajectory_refs
        )
        return [AsyncToolCallExecutor.wrapping(branch) for branch in branches]

    @classmethod
    def wrapping(cls, executor: ToolCallExecutor) -> AsyncToolCallExecutor:
        wrapped = cls.__new__(cls)
        wrapped.executor = executor
        return wrapped

    async def flush(self) -> None:
        await asyncio.to_thread(self.executor.flush)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.executor.close)

    async def __aenter__(self) -> AsyncToolCallExecutor:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
