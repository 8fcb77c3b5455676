"""The replay loop: every epoch, every arm runs the same seeded rollouts of every task.

Arms:
- `nocache`: each rollout in a fresh local sandbox of the workload, every call executed;
- `client`: tvclient's ToolCallExecutor over the same local sandboxes (client mode);
- `server`: POST .../rollouts/{id}/calls, the service runs the sandboxes (tool-server mode).
A budget suffix (`client-b8`, `server-b8`) gives the arm's tasks that snapshot budget; without
one the budget is unlimited (NO_BUDGET). Each arm has tasks of its own, so graphs never mix.
With a FaultPlan (`--faults`, faults.py) the rollouts meet timeouts, environment errors, sandbox
deaths and service restarts, and the check and the oracle take them into account.

The policies are open loop (a rollout's calls never depend on the results), so the `nocache`
arm executes exactly the history of every cached call in a fresh sandbox: the exactness check
compares every hit (and, as a determinism audit, every miss) with it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import statistics
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter, defaultdict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from tqdm import tqdm
from tvclient import SnapshotStore, TVCacheClient, ToolCallExecutor, ToolExecutionEnvironment
from tvclient.errors import TVCacheError, TVCacheUnavailable

from cache.tcg import TaskPolicy, ToolCall, call_digest, next_state_key, root_state_key

from .faults import Fault, FaultPlan, divergence_count, faulty_answer, kill_rollout_sandbox, timed_out

log = logging.getLogger("tvcache.replay")

Call = dict[str, Any]
NO_BUDGET = 100_000  # live snapshots per task: in effect unlimited
MODES = ("nocache", "client", "server")
STATS_SETTLE_S = 0.6  # over twice the service's default counter flush interval (0.25 s)
# Under faults: how long a rollout keeps sending a request the service did not answer (a restart).
RETRY_WINDOW_S = 120.0
ENV_FAULTS = ("error_after", "timeout_after")
# A mismatch is checked against up to this many more fresh executions of the rollout's own
# history, paced differently (a rollout's pacing is not part of its history: back to back, at the
# replay's thinking time, and with up to 1.5 s between calls, in turn). An answer one of them gives
# is a live outcome of the history: the call is nondeterministic (timing: whether a same-size
# rewrite lands in the second a bytecode cache recorded depends on how long the calls between
# took), counted apart from the mismatches, which no fresh execution reproduced.
REPRODUCE_TRIES = 8
VERIFY_STEP = "verify"  # the step label of a call that runs the task's verifier (Workload.steps)
EXACT_KEYS = ("hits_checked", "hits_mismatches", "misses_checked", "misses_mismatches", "not_compared",
              "hits_nondeterministic", "misses_nondeterministic",
              "after_event_hits_checked", "after_event_hits_mismatches", "after_event_misses_checked",
              "after_event_misses_mismatches")


@dataclass(frozen=True)
class ReplayTask:
    """One task: its tool policy, how the service runs it, how the harness runs it locally."""

    name: str
    tools: dict[str, dict[str, bool]]
    client_env: dict[str, Any]  # {"backend": "external", ...}: hashed into the fingerprint
    server_env: dict[str, Any] | None  # None: the service cannot run this task's tools
    make_env: Callable[[], ToolExecutionEnvironment]


class Workload(ABC):
    name: str
    # Tool-server mode: charged by the harness after every call the service executed (a miss),
    # for latency the service's own backend does not model (the sql workload's remote database).
    server_miss_penalty_ms: float = 0.0
    # The faults its rollouts can meet under --faults (faults.KIND_MODES); `timeout` needs timeout_call.
    fault_kinds: tuple[str, ...] = ("error_after", "timeout_after")

    def timeout_call(self, call: Call, timeout_s: float) -> Call | None:
        """`call` with a `timeout_s` that kills it mid-run at a point that does not depend on
        timing, or None when the workload has no such call."""
        return None

    @abstractmethod
    def tasks(self) -> list[ReplayTask]: ...

    @abstractmethod
    def rollouts(self, task: ReplayTask, epoch: int) -> list[list[Call]]:
        """The epoch's rollouts of `task`, a pure function of the seed, the task and the epoch."""

    def steps(self, task: ReplayTask, epoch: int) -> list[list[str | None]] | None:
        """A label per call of each of `rollouts(task, epoch)`: the step of the rollout the call
        belongs to (VERIFY_STEP: a run of the task's verifier, which computes the reward), None
        for a call of no named step; None when the workload names no steps. Labels are the
        harness's: they are not sent, and the calls are the same with or without them."""
        return None

    def describe(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Arm:
    name: str
    mode: str
    budget: int | None = None

    @classmethod
    def parse(cls, text: str) -> Arm:
        mode, _, budget = text.partition("-b")
        if mode not in MODES:
            raise ValueError(f"unknown arm {text!r}: use nocache, client, server, optionally with -b<budget>")
        return cls(text, mode, int(budget) if budget else None)


def digest(result: Any) -> str:
    return hashlib.sha256(json.dumps(result, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Sandbox metering (client and nocache arms): time spent inside sandboxes, starts, forks.


class _Meter(threading.local):
    env_ms = 0.0
    lookup_ms = 0.0
    lookup_server_ms: float | None = 0.0
    # Under faults: (kind, call) an environment fault waits for on this rollout's thread, and
    # whether it fired (the rollout's environment ran that call).
    armed: tuple[str, Call] | None = None
    fired = False


class TimedClient(TVCacheClient):
    """Adds the time of each lookup, and the service's share of it, to the calling thread's
    meter (client mode)."""

    def lookup(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            result = super().lookup(*args, **kwargs)
        finally:
            _meter.lookup_ms += (time.perf_counter() - started) * 1000
        # None as soon as one lookup of the call went without the service's figure.
        if _meter.lookup_server_ms is not None:
            _meter.lookup_server_ms = None if result.server_ms is None else _meter.lookup_server_ms + result.server_ms
        return result


_meter = _Meter()


class SandboxCounts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def add(self, key: str, n: float = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self.counts = dict(self.counts), Counter()
        return out


class MeteredEnvironment(ToolExecutionEnvironment):
    """Wraps a workload's environment: adds the time spent in it to the calling thread's meter
    and counts starts, snapshots (forks of an env that ran calls) and resume forks."""

    def __init__(self, inner: ToolExecutionEnvironment, counts: SandboxCounts, *, ran: bool = False):
        self.inner = inner
        self.counts = counts
        self.backend = inner.backend
        self._ran = ran

    def _timed(self, fn, *args):
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            _meter.env_ms += (time.perf_counter() - started) * 1000

    def start(self) -> None:
        self.counts.add("starts")
        self._timed(self.inner.start)

    def execute(self, call: Call) -> dict[str, Any]:
        self._ran = True
        return self._faulted(call, self._timed(self.inner.execute, call))

    def execute_observed(self, call: Call) -> tuple[dict[str, Any], bool | None]:
        self._ran = True
        result, observed = self._timed(self.inner.execute_observed, call)
        return self._faulted(call, result), observed

    @staticmethod
    def _faulted(call: Call, result: dict[str, Any]) -> dict[str, Any]:
        """The call ran; an environment fault armed for it on this thread answers (or raises) now."""
        armed = _meter.armed
        if armed is None or armed[1] != call:
            return result
        _meter.armed, _meter.fired = None, True
        return faulty_answer(armed[0], result)

    def file_times(self) -> Mapping[str, int] | None:
        return self._timed(self.inner.file_times)

    def restore_file_times(self, times: Mapping[str, int]) -> None:
        self._timed(self.inner.restore_file_times, times)

    def fork(self) -> MeteredEnvironment:
        twin = self._timed(self.inner.fork)
        if self._ran:  # the executor freezing a snapshot of a rollout's env
            self.counts.add("snapshots")
            self.counts.add("snapshot_bytes", getattr(twin, "size_bytes", 0) or 0)
        else:  # a rollout resuming from a frozen snapshot
            self.counts.add("resume_forks")
        return MeteredEnvironment(twin, self.counts)

    def stop(self) -> None:
        self._timed(self.inner.stop)

    def mutates_state(self, call: Call) -> bool:
        return self.inner.mutates_state(call)


# ---------------------------------------------------------------------------------------------
# Measurements


def call_keys(task: ReplayTask, samples: list[CallSample], calls: list[Call]) -> list[tuple[str, str] | None]:
    """Each call's (anchor state key, call digest) as the service keys it, None where the tool
    is not cacheable: the harness's own oracle is computed from these (report.py). A call the
    service answered as read-only (`sample.mutates` False) leaves the state key as it was."""
    policy = TaskPolicy.from_json(task.tools)
    state = root_state_key(hashlib.sha256(task.name.encode()).hexdigest())  # keys are compared within a task
    keys = []
    for sample, call in zip(samples, calls):
        tool_call = ToolCall.from_json(call)
        digest = call_digest(tool_call)
        tool = policy.for_tool(tool_call.tool)
        keys.append((state, digest) if tool.cacheable else None)
        if tool.changes_state(sample.mutates):
            state = next_state_key(state, digest)
    return keys


@dataclass
class CallSample:
    task: str
    epoch: int
    rollout: int
    position: int
    tool: str
    latency_ms: float
    cached: bool | None  # None in the nocache arm
    env_ms: float | None  # time inside local sandboxes during the call (nocache, client)
    result_digest: str
    lookup_ms: float | None = None  # client mode: the lookup request
    lookup_server_ms: float | None = None  # client mode: the service's own time on it (Server-Timing)
    # client mode: time the call waited for the previous miss's background work (record, snapshot)
    background_wait_ms: float | None = None
    result: Any = None  # kept only until compared
    started: float = 0.0  # perf_counter when the call was sent (last sent, if it was sent again)
    key: tuple[str, str] | None = None  # (anchor state key, call digest); None for a tool that is not cacheable
    mutates: bool | None = None  # whether the call changed the state, as the service or executor tells
    # Under faults (faults.py):
    fault: str | None = None  # the fault that hit this call (sandbox_death: its container died just before)
    injected: bool = False  # its answer is an injected fault's, not the tool's: not compared
    failed: bool = False  # it got no answer (the service failed, also when sent again): not compared
    retries: int = 0  # times it was sent again because the service did not answer
    answer_timed_out: bool = False  # its answer says timed out (a hit too: the cache kept a timed-out answer)
    event: bool = False  # it left its rollout's state unknown (mark_unknown_state): its answer is not to share
    unshared: bool = False  # it comes after such an event of its rollout: off the shared graph
    step: str | None = None  # the workload's label of the call (Workload.steps), e.g. VERIFY_STEP
    # tool-server mode, a miss: where the service spent its time, by phase (CallResult.phases_ms)
    phases_ms: dict[str, float] | None = None


def mark_unknown_state(samples: list[CallSample]) -> None:
    """The known-state rule on one rollout's samples, in order: a call that ran and timed out, an
    injected environment fault and a call left without an answer leave the state unknown; the
    rollout's calls from there are off the shared graph. A sandbox death between two calls does
    not: no call was running, the service retires the dead sandbox and the rollout goes on from
    its history (which the wrong-answer counts check). A hit that answers timed out ran nothing:
    it is a wrong answer (counted), not an event."""
    unknown = False
    for sample in samples:
        sample.unshared = unknown
        sample.answer_timed_out = timed_out(sample.result)
        sample.event = sample.injected or sample.failed or (sample.answer_timed_out and not sample.cached)
        unknown = unknown or sample.event


@dataclass
class RolloutSample:
    task: str
    rollout: int
    seconds: float
    calls: int


@dataclass
class EpochRun:
    arm: str
    epoch: int
    calls: list[CallSample] = field(default_factory=list)
    rollouts: list[RolloutSample] = field(default_factory=list)
    step_s: float = 0.0
    warm_wait_s: float = 0.0
    sandboxes: dict[str, float] = field(default_factory=dict)
    service: dict[str, Any] = field(default_factory=dict)
    exact: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# The replay


@dataclass
class ReplayConfig:
    epochs: int
    arms: list[Arm]
    concurrency: int
    seed: int
    run_tag: str
    think_ms: float = 0.0  # the policy's generation time before each call (mean); see Replay.thinking
    warm_wait_s: float = 5.0
    keep_examples: int = 5
    faults: FaultPlan | None = None
    audit_rate: float | None = None  # the tasks' determinism-audit rate; None: the service's default
    # Kills the service and starts it again (the fault arm's restart); None: no restart.
    restart_service: Callable[[], None] | None = None


class Replay:
    def __init__(self, workload: Workload, client: TVCacheClient, config: ReplayConfig, progress_stream=None):
        self.workload = workload
        self.client = client
        self.config = config
        self.tasks = workload.tasks()
        self.runs: list[EpochRun] = []
        self.per_tool: dict[str, list[dict[str, Any]]] = {}
        self.divergences: dict[str, dict[str, int] | None] = {}  # per arm, as the service's stats report them
        self.mismatch_examples: list[dict[str, Any]] = []
        self.faults_planned: dict[str, Counter[str]] = {arm.name: Counter() for arm in config.arms}
        self.restarts: list[dict[str, Any]] = []
        self._counts = {arm.name: SandboxCounts() for arm in config.arms}
        self._snapshots = {arm.name: SnapshotStore() for arm in config.arms if arm.mode == "client"}
        self._progress_stream = progress_stream
        self._faults: dict[tuple[str, int, int], Fault | None] = {}
        self._steps: dict[tuple[str, int], list[list[str | None]]] = {}
        self._calls_done = 0
        self._calls_lock = threading.Lock()

    def task_id(self, task: ReplayTask, arm: Arm) -> str:
        return f"rp-{self.config.run_tag}-{task.name}-{arm.name}"[:200]

    def arm_task_ids(self, arm: Arm) -> list[str]:
        return [self.task_id(task, arm) for task in self.tasks]

    def run(self) -> list[EpochRun]:
        self._put_tasks()
        plans = {(task.name, epoch): self._plan(task, epoch)
                 for epoch in range(self.config.epochs) for task in self.tasks}
        total = sum(len(p) for p in plans.values()) * len(self.config.arms)
        progress = tqdm(total=total, unit="rollout", file=self._progress_stream or sys.stderr, mininterval=0.2,
                        dynamic_ncols=True)
        try:
            for epoch in range(self.config.epochs):
                epoch_runs = {}
                for arm in self.config.arms:
                    epoch_runs[arm.name] = self._run_epoch(arm, epoch, plans, progress)
                self._check_exactness(epoch_runs, plans, epoch)
                self.runs.extend(epoch_runs.values())
            self._collect_per_tool()
        finally:
            progress.close()
            for store in self._snapshots.values():
                store.close()
        return self.runs

    def server_task_ids(self) -> list[str]:
        """The tasks whose sandboxes the service runs (the tool-server arms')."""
        return [task_id for arm in self.config.arms if arm.mode == "server" for task_id in self.arm_task_ids(arm)]

    def _plan(self, task: ReplayTask, epoch: int) -> list[list[Call]]:
        """The epoch's rollouts of the task as every arm issues them; under faults, each
        rollout's fault is chosen here and the faults that are part of the world applied."""
        rollouts = self.workload.rollouts(task, epoch)
        steps = self.workload.steps(task, epoch)
        if steps is not None:  # a fault changes a call in place: the labels keep their positions
            self._steps[(task.name, epoch)] = steps
        plan = self.config.faults
        if plan is None:
            return rollouts
        out = []
        for index, calls in enumerate(rollouts):
            fault = plan.choose(self.workload, task.name, epoch, index, calls)
            self._faults[(task.name, epoch, index)] = fault
            for arm in self.config.arms:
                if fault is not None and fault.applies(arm.mode):
                    self.faults_planned[arm.name][fault.kind] += 1
            out.append(plan.world(self.workload, calls, fault))
        return out

    def fault(self, arm: Arm, task: ReplayTask, epoch: int, index: int) -> Fault | None:
        """The rollout's fault in this arm, if it meets one there."""
        fault = self._faults.get((task.name, epoch, index))
        return fault if fault is not None and fault.applies(arm.mode) else None

    # -- setup ----------------------------------------------------------------------------------

    def _put_tasks(self) -> None:
        for arm in self.config.arms:
            if arm.mode == "nocache":
                continue
            budget = NO_BUDGET if arm.budget is None else arm.budget
            for task in self.tasks:
                env = task.client_env if arm.mode == "client" else task.server_env
                if env is None:
                    raise ValueError(f"task {task.name} cannot run in tool-server mode")
                self.client.put_task(self.task_id(task, arm), env=env, tools=task.tools, sandbox_budget=budget,
                                     audit_rate=self.config.audit_rate)

    # -- one epoch of one arm ---------------------------------------------------------------------

    def _run_epoch(self, arm: Arm, epoch: int, plans, progress: tqdm) -> EpochRun:
        run = EpochRun(arm=arm.name, epoch=epoch)
        if arm.mode == "server":
            run.warm_wait_s = self._announce(arm, epoch, plans)
        sandboxes_before = self._service_sandboxes(arm) if arm.mode == "server" else 0
        jobs = [(task, index, calls) for task in self.tasks for index, calls in enumerate(plans[(task.name, epoch)])]
        lock = threading.Lock()

        def one(job):
            task, index, calls = job
            started = time.perf_counter()
            samples = self._rollout(arm, task, epoch, index, calls)
            mark_unknown_state(samples)
            steps = self._steps.get((task.name, epoch))
            for sample, key in zip(samples, call_keys(task, samples, calls)):
                sample.key = key
                sample.step = steps[index][sample.position] if steps else None
            seconds = time.perf_counter() - started
            with lock:
                run.calls.extend(samples)
                run.rollouts.append(RolloutSample(task.name, index, seconds, len(calls)))
                progress.set_description(f"epoch {epoch} {arm.name}", refresh=False)
                progress.update()

        self._calls_done = 0
        finished = threading.Event()
        restart = self._restart_thread(arm, epoch, sum(len(calls) for _, _, calls in jobs), finished)
        retried_before = self.client.availability.retried
        started = time.perf_counter()
        try:
            with ThreadPoolExecutor(max_workers=self.config.concurrency) as pool:
                for future in [pool.submit(one, job) for job in jobs]:
                    future.result()
        finally:
            finished.set()
            if restart is not None:
                restart.join()
                for entry in self.restarts:  # requests the restart cut off that tvclient sent again itself
                    if entry["arm"] == arm.name and entry["epoch"] == epoch:
                        entry["client_retried_requests"] = self.client.availability.retried - retried_before
        run.step_s = time.perf_counter() - started
        run.sandboxes = self._counts[arm.name].take()
        if arm.mode == "server":
            run.sandboxes["starts"] = self._service_sandboxes(arm) - sandboxes_before
        if arm.mode != "nocache":
            run.service = self._service_epoch(arm, epoch)
        return run

    def _call_done(self) -> None:
        with self._calls_lock:
            self._calls_done += 1

    def _restart_thread(self, arm: Arm, epoch: int, calls: int, finished: threading.Event) -> threading.Thread | None:
        """Under faults, in the arm's restart epoch: a thread that restarts the service once the
        rollouts have made the planned number of calls (they are in flight meanwhile), unless
        the epoch is over first."""
        plan = self.config.faults
        if plan is None or arm.mode == "nocache" or self.config.restart_service is None:
            return None
        point = plan.restart_point(arm.name, self.config.epochs, calls)
        if point is None or point[0] != epoch:
            return None
        after_calls = point[1]

        def restart() -> None:
            while self._calls_done < after_calls:
                if finished.wait(0.005):
                    return
            started = time.perf_counter()
            entry: dict[str, Any] = {"arm": arm.name, "epoch": epoch, "after_calls": self._calls_done}
            try:
                self.config.restart_service()
            except Exception as exc:  # reported; the rollouts then fail their retries and say so
                log.exception("restarting the service failed")
                entry["error"] = repr(exc)
            entry["down_s"] = round(time.perf_counter() - started, 3)
            self.restarts.append(entry)

        thread = threading.Thread(target=restart, name=f"replay-restart-{arm.name}", daemon=True)
        thread.start()
        return thread

    def _announce(self, arm: Arm, epoch: int, plans) -> float:
        """Tool-server mode: announce the step, then give the workers up to warm_wait_s to warm
        the roots and pre-forks (in training this overlaps the policy's first generation)."""
        rollouts = max(len(plans[(task.name, epoch)]) for task in self.tasks)
        ids = set(self.arm_task_ids(arm))
        started = time.perf_counter()
        self.client.announce_step(sorted(ids), rollouts, epoch)
        deadline = started + self.config.warm_wait_s
        while time.perf_counter() < deadline:
            pools = self.client.pools()["pools"]
            if not any(pool["states"].get("warming") for pool in pools if pool["task_id"] in ids):
                break
            time.sleep(0.1)
        return time.perf_counter() - started

    def _service_sandboxes(self, arm: Arm) -> int:
        """Sandboxes the service started or forked for the arm's tasks (that got running)."""
        return sum(self.client.sandboxes(task_id)["started"] for task_id in self.arm_task_ids(arm))

    def _settled_stats(self, arm: Arm) -> dict[str, dict[str, Any]]:
        """The arm's task stats once they stop moving. Each server process buffers its lookup
        counters for TVCACHE_COUNTER_FLUSH_S (a stats read flushes only the answering process's
        buffer), so two reads STATS_SETTLE_S apart that agree hold every counter of the epoch."""
        pause = STATS_SETTLE_S
        stats = {task_id: self.client.stats(task_id) for task_id in self.arm_task_ids(arm)}
        for _ in range(20):
            time.sleep(pause)
            again = {task_id: self.client.stats(task_id) for task_id in stats}
            if [s["per_epoch"] for s in again.values()] == [s["per_epoch"] for s in stats.values()]:
                return again
            stats = again
        log.warning("service stats still moving after %.1f s", 20 * pause)
        return stats

    def _service_epoch(self, arm: Arm, epoch: int) -> dict[str, Any]:
        out: Counter[str] = Counter()
        for stats in self._settled_stats(arm).values():
            row = next((r for r in stats["per_epoch"] if r["epoch"] == epoch), {})
            for key in ("calls", "hits", "oracle_hits", "executed_ms", "saved_ms"):
                out[key] += row.get(key, 0) or 0
            out["snapshots_live"] += stats["snapshots"]["live"]
            out["snapshot_bytes_live"] += stats["snapshots"]["live_bytes"]
            out["snapshots_evicted"] += stats["snapshots"]["evicted"]
            out["nodes"] += stats["nodes"]
        result = dict(out)
        calls = result.get("calls", 0)
        result["hit_rate"] = result.get("hits", 0) / calls if calls else 0.0
        result["oracle_hit_rate"] = result.get("oracle_hits", 0) / calls if calls else 0.0
        return result

    # -- one rollout ----------------------------------------------------------------------------

    def _rollout(self, arm: Arm, task: ReplayTask, epoch: int, index: int, calls: list[Call]) -> list[CallSample]:
        think = self.thinking(task, epoch, index, len(calls))
        if arm.mode == "nocache":
            return self._rollout_nocache(arm, task, epoch, index, calls, think)
        fault = self.fault(arm, task, epoch, index)
        if arm.mode == "client":
            return self._rollout_client(arm, task, epoch, index, calls, think, fault)
        return self._rollout_server(arm, task, epoch, index, calls, think, fault)

    def thinking(self, task: ReplayTask, epoch: int, index: int, calls: int) -> list[float]:
        """Seconds the policy generates before each call: 0.5x to 1.5x the mean, seeded per
        rollout, the same in every arm. Real rollouts are not back to back: without it the
        rollouts are a closed-loop load generator and the service is measured saturated."""
        mean_s = self.config.think_ms / 1000
        rng = random.Random(f"{self.config.seed}-think-{task.name}-{epoch}-{index}")
        return [mean_s * rng.uniform(0.5, 1.5) for _ in range(calls)]

    def _sample(self, task, epoch, index, position, call, latency_ms, cached, env_ms, result) -> CallSample:
        self._call_done()
        return CallSample(task.name, epoch, index, position, call["tool"], latency_ms, cached, env_ms, digest(result),
                          result=result, started=time.perf_counter() - latency_ms / 1000)

    def _rollout_nocache(self, arm, task, epoch, index, calls, think) -> list[CallSample]:
        samples = []
        env = MeteredEnvironment(task.make_env(), self._counts[arm.name])
        _meter.env_ms = 0.0
        env.start()  # counted in the rollout's time, not in its first call's latency
        try:
            for position, call in enumerate(calls):
                time.sleep(think[position])
                _meter.env_ms = 0.0
                started = time.perf_counter()
                result = env.execute(call)
                latency = (time.perf_counter() - started) * 1000
                samples.append(self._sample(task, epoch, index, position, call, latency, None, _meter.env_ms, result))
        finally:
            env.stop()
        return samples

    def _rollout_client(self, arm, task, epoch, index, calls, think, fault: Fault | None) -> list[CallSample]:
        samples = []
        counts = self._counts[arm.name]

        def factory() -> ToolExecutionEnvironment:
            return MeteredEnvironment(task.make_env(), counts)

        with ToolCallExecutor(self.client, self.task_id(task, arm), factory, rollout_id=f"e{epoch}-r{index}",
                              epoch=epoch, snapshots=self._snapshots[arm.name]) as executor:
            for position, call in enumerate(calls):
                time.sleep(think[position])
                _meter.env_ms = _meter.lookup_ms = _meter.lookup_server_ms = 0.0
                armed = fault is not None and fault.kind in ENV_FAULTS and fault.position == position
                _meter.armed, _meter.fired = ((fault.kind, call) if armed else None), False
                hits, keyed, waited_ms = executor.hits, len(executor.history), executor.background_wait_ms
                started = time.perf_counter()
                try:
                    result, retries, failed, sent = self._client_execute(executor, call)
                finally:
                    _meter.armed = None
                latency = (time.perf_counter() - started) * 1000
                sample = self._sample(task, epoch, index, position, call, latency, executor.hits > hits,
                                      _meter.env_ms, result)
                sample.started = sent
                sample.lookup_ms, sample.lookup_server_ms = _meter.lookup_ms, _meter.lookup_server_ms
                sample.background_wait_ms = executor.background_wait_ms - waited_ms
                # Left out of the history: read-only. A call the environment failed after ran, and
                # a rollout off the shared graph keeps no history: those are keyed as the tool's
                # policy says.
                detached = getattr(executor, "detached", False)
                # A fault that fired on a hit fired in its audit's re-execution (a sampled hit run
                # again in the open environment): the answer is the cache's, and the executor
                # dropped the environment, so the rollout's state is known.
                fired = _meter.fired and not sample.cached
                sample.mutates = None if fired or failed or detached else len(executor.history) > keyed
                sample.injected, sample.failed, sample.retries = fired, failed, retries
                sample.fault = fault.kind if fired else ("timeout" if timed_out(result) and not sample.cached
                                                         else None)
                samples.append(sample)
            _meter.env_ms = 0.0
        return samples

    def _client_execute(self, executor: ToolCallExecutor, call: Call) -> tuple[Any, int, bool, float]:
        """The executor's answer, the times the call was sent again, whether it got none and
        when it was last sent. An injected environment fault is the answer; a failed lookup or
        replay record (the service restarting) leaves the executor where it was, so the call is
        sent again."""

        def execute() -> Any:
            try:
                return executor.execute(call)
            except Exception as exc:
                if _meter.fired:  # the environment ran the call, then failed
                    return {"error": f"{type(exc).__name__}: {exc}"}
                raise

        result, retries, error, sent = self._retrying(execute)
        return (result, retries, False, sent) if error is None else ({"error": error}, retries, True, sent)

    def _rollout_server(self, arm, task, epoch, index, calls, think, fault: Fault | None) -> list[CallSample]:
        samples = []
        task_id, rollout_id = self.task_id(task, arm), f"e{epoch}-r{index}"
        penalty_s = self.workload.server_miss_penalty_ms / 1000
        death = fault.position if fault is not None and fault.kind == "sandbox_death" else None
        try:
            for position, call in enumerate(calls):
                time.sleep(think[position])
                killed = None
                if death is not None and position >= death:
                    # The first time it has one (the service says which, even while it restarts).
                    killed = self._retrying(lambda: kill_rollout_sandbox(self.client, task_id, rollout_id))[0]
                    death = None if killed else death
                started = time.perf_counter()
                answer, retries, error, sent = self._retrying(
                    lambda: self.client.call(task_id, rollout_id, call, epoch=epoch))
                if answer is not None and not answer.cached and penalty_s:
                    time.sleep(penalty_s)
                latency = (time.perf_counter() - started) * 1000
                result = answer.result if answer is not None else {"error": error}
                sample = self._sample(task, epoch, index, position, call, latency,
                                      answer.cached if answer is not None else False, None, result)
                sample.mutates = answer.mutates if answer is not None else None
                if answer is not None and not answer.cached:
                    sample.phases_ms = dict(answer.phases_ms)
                sample.failed, sample.retries, sample.started = answer is None, retries, sent
                sample.fault = "sandbox_death" if killed else ("timeout" if timed_out(result) and not sample.cached
                                                               else None)
                samples.append(sample)
        finally:
            self._retrying(lambda: self.client.end_rollout(task_id, rollout_id))
        return samples

    def _retrying(self, request: Callable[[], Any]) -> tuple[Any, int, str | None, float]:
        """(answer, times sent again, None, when last sent: the oracle orders calls by it), or
        (None, times sent again, the last error, when last sent) when the service gave no answer
        within RETRY_WINDOW_S. Only under faults is a request sent again, while the service is
        unreachable or down (TVCacheUnavailable: a restart, a sandbox that died) or still holds
        the rollout for a request that a restart cut off."""
        sent = time.perf_counter()
        if self.config.faults is None:
            return request(), 0, None, sent
        retries, deadline = 0, time.monotonic() + RETRY_WINDOW_S
        while True:
            try:
                return request(), retries, None, sent
            except TVCacheError as exc:
                if not (isinstance(exc, TVCacheUnavailable) or exc.code == "rollout_busy"):
                    raise
                if time.monotonic() > deadline:
                    return None, retries, f"{type(exc).__name__}: {exc}", sent
            retries += 1
            time.sleep(0.2)
            sent = time.perf_counter()

    # -- exactness --------------------------------------------------------------------------------

    def _check_exactness(self, epoch_runs: dict[str, EpochRun], plans, epoch: int) -> None:
        """Every cached answer against the nocache arm's fresh execution of the same history; a
        mismatch against more fresh executions (REPRODUCE_TRIES)."""
        fresh_run = next((run for name, run in epoch_runs.items() if Arm.parse(name).mode == "nocache"), None)
        if fresh_run is None:
            raise ValueError("the exactness check needs the nocache arm")
        fresh = {(s.task, s.rollout, s.position): s for s in fresh_run.calls}
        for run in epoch_runs.values():
            tally: Counter[str] = Counter()
            mismatched_tools: Counter[str] = Counter()
            for sample in run.calls:
                if sample.cached is None:
                    continue
                if sample.injected or sample.failed:  # the answer is the fault's, or there is none
                    tally["not_compared"] += 1
                    continue
                reference = fresh[(sample.task, sample.rollout, sample.position)]
                kind = "hits" if sample.cached else "misses"
                # Also after an unknown-state event: the fresh execution met the same timeouts, and
                # an environment fault or a dead sandbox came after its call had run.
                prefixes = ("", "after_event_") if sample.unshared else ("",)
                for prefix in prefixes:
                    tally[f"{prefix}{kind}_checked"] += 1
                if reference.result_digest != sample.result_digest:
                    calls = plans[(sample.task, epoch)][sample.rollout][: sample.position + 1]
                    tries = self._reproduced(sample, calls)
                    if tries is not None:
                        tally[f"{kind}_nondeterministic"] += 1
                        self._keep_example(run, sample, reference, reproduced_after=tries)
                        continue
                    for prefix in prefixes:
                        tally[f"{prefix}{kind}_mismatches"] += 1
                    mismatched_tools[sample.tool] += 1
                    self._keep_example(run, sample, reference)
            run.exact = {key: tally.get(key, 0) for key in EXACT_KEYS}
            run.exact["mismatched_tools"] = dict(mismatched_tools)
        for run in epoch_runs.values():
            for sample in run.calls:
                sample.result = None

    def _reproduced(self, sample: CallSample, calls: list[Call]) -> int | None:
        """After how many fresh executions of `calls` (the rollout's history and the call) one
        answered as `sample` did; None if none of REPRODUCE_TRIES did."""
        task = next(t for t in self.tasks if t.name == sample.task)
        rng = random.Random(f"{self.config.seed}-reproduce-{sample.task}-{sample.rollout}-{sample.position}")
        paces = (lambda: 0.0, lambda: self.config.think_ms / 1000 * rng.uniform(0.5, 1.5), lambda: rng.uniform(0, 1.5))
        for attempt in range(1, REPRODUCE_TRIES + 1):
            pace = paces[(attempt - 1) % len(paces)]
            env = task.make_env()
            env.start()
            try:
                for call in calls:
                    time.sleep(pace())
                    result = env.execute(call)
            finally:
                env.stop()
            if digest(result) == sample.result_digest:
                return attempt
        return None

    def _keep_example(self, run: EpochRun, sample: CallSample, reference: CallSample,
                      reproduced_after: int | None = None) -> None:
        if len(self.mismatch_examples) >= self.config.keep_examples:
            return
        fault = self._faults.get((sample.task, run.epoch, sample.rollout))
        self.mismatch_examples.append({
            "arm": run.arm, "epoch": run.epoch, "task": sample.task, "rollout": sample.rollout,
            "position": sample.position, "cached": sample.cached, "call": sample.tool,
            "result": json.loads(json.dumps(sample.result)), "fresh": json.loads(json.dumps(reference.result)),
            **({"reproduced_after_fresh_executions": reproduced_after} if reproduced_after is not None else {}),
            **({"after_unknown_state": sample.unshared, "retries": sample.retries,
                "rollout_fault": None if fault is None or not fault.applies(Arm.parse(run.arm).mode)
                else {"kind": fault.kind, "position": fault.position}}
               if self.config.faults is not None else {})})

    def _collect_per_tool(self) -> None:
        for arm in self.config.arms:
            if arm.mode == "nocache":
                continue
            tools: dict[str, Counter] = defaultdict(Counter)
            divergences: dict[str, int] | None = None  # None: the service's stats carry none
            for task_id in self.arm_task_ids(arm):
                stats = self.client.stats(task_id)
                for row in stats["per_tool"]:
                    for key in ("calls", "hits", "oracle_hits", "saved_ms", "executed_ms"):
                        tools[row["tool"]][key] += row.get(key, 0) or 0
                counted = divergence_count(stats)
                if counted is not None:
                    divergences = divergences or {}
                    for key, n in counted.items():
                        divergences[key] = divergences.get(key, 0) + n
            self.divergences[arm.name] = divergences
            self.per_tool[arm.name] = [
                {"tool": tool, **dict(c), "hit_rate": c["hits"] / c["calls"] if c["calls"] else 0.0,
                 "oracle_hit_rate": c["oracle_hits"] / c["calls"] if c["calls"] else 0.0}
                for tool, c in sorted(tools.items())
            ]


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0
