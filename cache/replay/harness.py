"""The replay loop: every epoch, every arm runs the same seeded rollouts of every task.

Arms:
- `nocache`: each rollout in a fresh local sandbox of the workload, every call executed;
- `client`: tvclient's ToolCallExecutor over the same local sandboxes (client mode);
- `server`: POST .../rollouts/{id}/calls, the service runs the sandboxes (tool-server mode).
A budget suffix (`client-b8`, `server-b8`) gives the arm's tasks that snapshot budget; without
one the budget is unlimited (NO_BUDGET). Each arm has tasks of its own, so graphs never mix.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from tvclient import SnapshotStore, TVCacheClient, ToolCallExecutor, ToolExecutionEnvironment

from cache.tcg import TaskPolicy, ToolCall, call_digest, next_state_key, root_state_key
from sandboxes.models import Sandbox
from sandboxes.services import tasks_release

log = logging.getLogger("tvcache.replay")

Call = dict[str, Any]
NO_BUDGET = 100_000  # live snapshots per task: in effect unlimited
MODES = ("nocache", "client", "server")
STATS_SETTLE_S = 0.6  # over twice the service's default counter flush interval (0.25 s)


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

    @abstractmethod
    def tasks(self) -> list[ReplayTask]: ...

    @abstractmethod
    def rollouts(self, task: ReplayTask, epoch: int) -> list[list[Call]]:
        """The epoch's rollouts of `task`, a pure function of the seed, the task and the epoch."""

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
        return self._timed(self.inner.execute, call)

    def execute_observed(self, call: Call) -> tuple[dict[str, Any], bool | None]:
        self._ran = True
        return self._timed(self.inner.execute_observed, call)

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
    started: float = 0.0  # perf_counter at the call's start
    key: tuple[str, str] | None = None  # (anchor state key, call digest); None for a tool that is not cacheable
    mutates: bool | None = None  # whether the call changed the state, as the service or executor tells
    # Where a miss's time went: the service's phases (tool-server mode), or the executor's lookup,
    # wait for the previous snapshot and time in the sandbox (client mode).
    phases_ms: dict[str, float] | None = None


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


class Progress:
    """A one-line progress bar on stderr (rewritten at most 5 times a second)."""

    def __init__(self, total: int, *, stream=None, width: int = 30) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.width = width
        self.started = time.perf_counter()
        self._shown = 0.0
        self._lock = threading.Lock()
        self.label = ""

    def advance(self, n: int = 1, label: str | None = None) -> None:
        with self._lock:
            self.done += n
            if label is not None:
                self.label = label
            now = time.perf_counter()
            if now - self._shown < 0.2 and self.done < self.total:
                return
            self._shown = now
            filled = int(self.width * self.done / self.total)
            elapsed = now - self.started
            eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
            self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} rollouts "
                              f"{elapsed:6.0f}s eta {eta:5.0f}s {self.label:<24}")
            if self.done >= self.total:
                self.stream.write("\n")
            self.stream.flush()


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
    # Stop the tool-server arms' sandboxes and free their snapshots at the end: set when the
    # service was started for the run and goes with it.
    release_sandboxes: bool = False


class Replay:
    def __init__(self, workload: Workload, client: TVCacheClient, config: ReplayConfig, progress_stream=None):
        self.workload = workload
        self.client = client
        self.config = config
        self.tasks = workload.tasks()
        self.runs: list[EpochRun] = []
        self.per_tool: dict[str, list[dict[str, Any]]] = {}
        self.mismatch_examples: list[dict[str, Any]] = []
        self._counts = {arm.name: SandboxCounts() for arm in config.arms}
        self._snapshots = {arm.name: SnapshotStore() for arm in config.arms if arm.mode == "client"}
        self._progress_stream = progress_stream

    def task_id(self, task: ReplayTask, arm: Arm) -> str:
        return f"rp-{self.config.run_tag}-{task.name}-{arm.name}"[:200]

    def arm_task_ids(self, arm: Arm) -> list[str]:
        return [self.task_id(task, arm) for task in self.tasks]

    def run(self) -> list[EpochRun]:
        self._put_tasks()
        plans = {(task.name, epoch): self.workload.rollouts(task, epoch)
                 for epoch in range(self.config.epochs) for task in self.tasks}
        total = sum(len(p) for p in plans.values()) * len(self.config.arms)
        progress = Progress(total, stream=self._progress_stream)
        try:
            for epoch in range(self.config.epochs):
                epoch_runs = {}
                for arm in self.config.arms:
                    epoch_runs[arm.name] = self._run_epoch(arm, epoch, plans, progress)
                self._check_exactness(epoch_runs)
                self.runs.extend(epoch_runs.values())
            self._collect_per_tool()
        finally:
            for store in self._snapshots.values():
                store.close()
            if self.config.release_sandboxes:
                tasks_release(task_ids=[task_id for arm in self.config.arms if arm.mode == "server"
                                        for task_id in self.arm_task_ids(arm)])
        return self.runs

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
                self.client.put_task(self.task_id(task, arm), env=env, tools=task.tools, sandbox_budget=budget)

    # -- one epoch of one arm ---------------------------------------------------------------------

    def _run_epoch(self, arm: Arm, epoch: int, plans, progress: Progress) -> EpochRun:
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
            for sample, key in zip(samples, call_keys(task, samples, calls)):
                sample.key = key
            seconds = time.perf_counter() - started
            with lock:
                run.calls.extend(samples)
                run.rollouts.append(RolloutSample(task.name, index, seconds, len(calls)))
            progress.advance(label=f"epoch {epoch} {arm.name}")

        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=self.config.concurrency) as pool:
            for future in [pool.submit(one, job) for job in jobs]:
                future.result()
        run.step_s = time.perf_counter() - started
        run.sandboxes = self._counts[arm.name].take()
        if arm.mode == "server":
            run.sandboxes["starts"] = self._service_sandboxes(arm) - sandboxes_before
        if arm.mode != "nocache":
            run.service = self._service_epoch(arm, epoch)
        return run

    def _announce(self, arm: Arm, epoch: int, plans) -> float:
        """Tool-server mode: announce the step, then give the workers up to warm_wait_s to warm
        the roots and pre-forks (in training this overlaps the policy's first generation)."""
        rollouts = max(len(plans[(task.name, epoch)]) for task in self.tasks)
        ids = self.arm_task_ids(arm)
        started = time.perf_counter()
        self.client.announce_step(ids, rollouts, epoch)
        deadline = started + self.config.warm_wait_s
        while time.perf_counter() < deadline:
            if not Sandbox.objects.filter(task_id__in=ids, state=Sandbox.State.WARMING).exists():
                break
            time.sleep(0.1)
        return time.perf_counter() - started

    def _service_sandboxes(self, arm: Arm) -> int:
        """Sandboxes the service started or forked for the arm's tasks (rows that got running)."""
        return Sandbox.objects.filter(task_id__in=self.arm_task_ids(arm), ready_at__isnull=False).count()

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
        if arm.mode == "client":
            return self._rollout_client(arm, task, epoch, index, calls, think)
        return self._rollout_server(arm, task, epoch, index, calls, think)

    def thinking(self, task: ReplayTask, epoch: int, index: int, calls: int) -> list[float]:
        """Seconds the policy generates before each call: 0.5x to 1.5x the mean, seeded per
        rollout, the same in every arm. Real rollouts are not back to back: without it the
        rollouts are a closed-loop load generator and the service is measured saturated."""
        mean_s = self.config.think_ms / 1000
        rng = random.Random(f"{self.config.seed}-think-{task.name}-{epoch}-{index}")
        return [mean_s * rng.uniform(0.5, 1.5) for _ in range(calls)]

    def _sample(self, task, epoch, index, position, call, latency_ms, cached, env_ms, result) -> CallSample:
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

    def _rollout_client(self, arm, task, epoch, index, calls, think) -> list[CallSample]:
        samples = []
        counts = self._counts[arm.name]

        def factory() -> ToolExecutionEnvironment:
            return MeteredEnvironment(task.make_env(), counts)

        with ToolCallExecutor(self.client, self.task_id(task, arm), factory, rollout_id=f"e{epoch}-r{index}",
                              epoch=epoch, snapshots=self._snapshots[arm.name]) as executor:
            for position, call in enumerate(calls):
                time.sleep(think[position])
                _meter.env_ms = _meter.lookup_ms = _meter.lookup_server_ms = 0.0
                hits, keyed, waited_ms = executor.hits, len(executor.history), executor.background_wait_ms
                started = time.perf_counter()
                result = executor.execute(call)
                latency = (time.perf_counter() - started) * 1000
                sample = self._sample(task, epoch, index, position, call, latency, executor.hits > hits,
                                      _meter.env_ms, result)
                sample.lookup_ms, sample.lookup_server_ms = _meter.lookup_ms, _meter.lookup_server_ms
                sample.background_wait_ms = executor.background_wait_ms - waited_ms
                sample.phases_ms = {"lookup": _meter.lookup_ms, "snapshot_wait": sample.background_wait_ms,
                                    "sandbox": _meter.env_ms}
                sample.mutates = len(executor.history) > keyed  # left out of the history: read-only
                samples.append(sample)
            _meter.env_ms = 0.0
        return samples

    def _rollout_server(self, arm, task, epoch, index, calls, think) -> list[CallSample]:
        samples = []
        task_id, rollout_id = self.task_id(task, arm), f"e{epoch}-r{index}"
        penalty_s = self.workload.server_miss_penalty_ms / 1000
        try:
            for position, call in enumerate(calls):
                time.sleep(think[position])
                started = time.perf_counter()
                answer = self.client.call(task_id, rollout_id, call, epoch=epoch)
                if not answer.cached and penalty_s:
                    time.sleep(penalty_s)
                latency = (time.perf_counter() - started) * 1000
                sample = self._sample(task, epoch, index, position, call, latency, answer.cached, None, answer.result)
                sample.mutates, sample.phases_ms = answer.mutates, dict(answer.phases_ms)
                samples.append(sample)
        finally:
            self.client.end_rollout(task_id, rollout_id)
        return samples

    # -- exactness --------------------------------------------------------------------------------

    def _check_exactness(self, epoch_runs: dict[str, EpochRun]) -> None:
        """Every cached answer against the nocache arm's fresh execution of the same history."""
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
                reference = fresh[(sample.task, sample.rollout, sample.position)]
                kind = "hits" if sample.cached else "misses"
                tally[f"{kind}_checked"] += 1
                if reference.result_digest != sample.result_digest:
                    tally[f"{kind}_mismatches"] += 1
                    mismatched_tools[sample.tool] += 1
                    if len(self.mismatch_examples) < self.config.keep_examples:
                        self.mismatch_examples.append({
                            "arm": run.arm, "epoch": run.epoch, "task": sample.task, "rollout": sample.rollout,
                            "position": sample.position, "cached": sample.cached, "call": sample.tool,
                            "result": json.loads(json.dumps(sample.result)),
                            "fresh": json.loads(json.dumps(reference.result))})
            run.exact = {key: tally.get(key, 0) for key in
                         ("hits_checked", "hits_mismatches", "misses_checked", "misses_mismatches")}
            run.exact["mismatched_tools"] = dict(mismatched_tools)
        for run in epoch_runs.values():
            for sample in run.calls:
                sample.result = None

    def _collect_per_tool(self) -> None:
        for arm in self.config.arms:
            if arm.mode == "nocache":
                continue
            tools: dict[str, Counter] = defaultdict(Counter)
            for task_id in self.arm_task_ids(arm):
                for row in self.client.stats(task_id)["per_tool"]:
                    for key in ("calls", "hits", "oracle_hits", "saved_ms", "executed_ms"):
                        tools[row["tool"]][key] += row.get(key, 0) or 0
            self.per_tool[arm.name] = [
                {"tool": tool, **dict(c), "hit_rate": c["hits"] / c["calls"] if c["calls"] else 0.0,
                 "oracle_hit_rate": c["oracle_hits"] / c["calls"] if c["calls"] else 0.0}
                for tool, c in sorted(tools.items())
            ]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0
