"""The replay loop: every epoch, every arm runs the same seeded rollouts of every task.

The parts, a concern each: the arms and their tasks on the service (arms.py), what every arm
issues (plans.py), how each arm runs a rollout (rollouts.py, metered by metering.py), the policy's
thinking (pacing.py), the fault arm's faults and restart (faults.py, restarts.py), the exactness
check (exactness/) and the service's own figures (stats.py). With a FaultPlan (`--faults`) the
rollouts meet timeouts, environment errors, sandbox deaths and service restarts, and the check
and the oracle take them into account.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from tvclient import TVCacheClient

from .arms import Arm, ArmTasks
from .exactness import ReplayReferee, call_keys
from .faults import FaultPlan
from .pacing import Pacing
from .plans import RolloutPlans
from .restarts import ServiceRestart
from .rollouts import arm_rollouts
from .samples import EpochRun, RolloutSample, mark_unknown_state
from .stats import ServiceStats
from .workload import Workload


@dataclass
class ReplayConfig:
    epochs: int
    arms: list[Arm]
    concurrency: int
    seed: int
    run_tag: str
    think_ms: float = 0.0  # the policy's generation time before each call (mean); see Pacing.thinking
    warm_wait_s: float = 5.0
    keep_examples: int = 5
    faults: FaultPlan | None = None
    audit_rate: float | None = None  # the tasks' determinism-audit rate; None: the service's default
    match: str | None = None  # the tasks' matching ("history" or "state"); None: the service's default
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
        self.arm_tasks = ArmTasks(client, config.run_tag, self.tasks, config.arms)
        self.plans = RolloutPlans(workload, self.tasks, config.arms, config.epochs, config.faults)
        self.pacing = Pacing(config.seed, config.think_ms)
        self.referee = ReplayReferee(self.tasks, self.plans, self.pacing, config.keep_examples)
        self.restart = ServiceRestart(client, config.faults, config.epochs, config.restart_service)
        self.stats = ServiceStats(client, self.arm_tasks)
        self.arm_rollouts = {
            arm.name: arm_rollouts(
                arm,
                self.restart.call_done,
                client=client,
                arm_tasks=self.arm_tasks,
                again=config.faults is not None,
                miss_penalty_ms=workload.server_miss_penalty_ms,
            )
            for arm in config.arms
        }
        self._progress_stream = progress_stream

    # What the report reads of the parts (report.py).
    @property
    def mismatch_examples(self) -> list[dict[str, Any]]:
        return self.referee.examples

    @property
    def faults_planned(self) -> dict[str, Counter[str]]:
        return self.plans.planned

    @property
    def restarts(self) -> list[dict[str, Any]]:
        return self.restart.restarts

    def run(self) -> list[EpochRun]:
        self.arm_tasks.put(self.config.audit_rate, self.config.match)
        total = sum(len(p) for p in self.plans.calls.values()) * len(self.config.arms)
        progress = tqdm(
            total=total, unit="rollout", file=self._progress_stream or sys.stderr, mininterval=0.2, dynamic_ncols=True
        )
        try:
            for epoch in range(self.config.epochs):
                epoch_runs = {}
                for arm in self.config.arms:
                    epoch_runs[arm.name] = self._run_epoch(arm, epoch, progress)
                self.referee.check(epoch_runs, epoch)
                self.runs.extend(epoch_runs.values())
            for arm in self.config.arms:
                if arm.mode != "nocache":
                    self.per_tool[arm.name], self.divergences[arm.name] = self.stats.per_tool(arm)
        finally:
            progress.close()
            for rollouts in self.arm_rollouts.values():
                rollouts.close()
        return self.runs

    def _run_epoch(self, arm: Arm, epoch: int, progress: tqdm) -> EpochRun:
        run = EpochRun(arm=arm.name, epoch=epoch)
        if arm.mode == "server":
            rollouts = max(len(self.plans.rollouts(task.name, epoch)) for task in self.tasks)
            run.warm_wait_s = self.arm_tasks.announce(arm, epoch, rollouts, self.config.warm_wait_s)
        sandboxes_before = self.stats.sandboxes_started(arm) if arm.mode == "server" else 0
        jobs = [
            (task, index, calls)
            for task in self.tasks
            for index, calls in enumerate(self.plans.rollouts(task.name, epoch))
        ]
        driver = self.arm_rollouts[arm.name]
        lock = threading.Lock()

        def one(job):
            task, index, calls = job
            started = time.perf_counter()
            think = self.pacing.thinking(task.name, epoch, index, len(calls))
            samples = driver.run(task, epoch, index, calls, think, self.plans.fault(arm, task.name, epoch, index))
            mark_unknown_state(samples)
            for sample, key in zip(samples, call_keys(task, samples, calls)):
                sample.key = key
                sample.step = self.plans.step(task.name, epoch, index, sample.position)
            seconds = time.perf_counter() - started
            with lock:
                run.calls.extend(samples)
                run.rollouts.append(RolloutSample(task.name, index, seconds, len(calls)))
                progress.set_description(f"epoch {epoch} {arm.name}", refresh=False)
                progress.update()

        with self.restart.during(arm, epoch, sum(len(calls) for _, _, calls in jobs)):
            started = time.perf_counter()
            with ThreadPoolExecutor(max_workers=self.config.concurrency) as pool:
                for future in [pool.submit(one, job) for job in jobs]:
                    future.result()
        run.step_s = time.perf_counter() - started
        run.sandboxes = driver.counts.take()
        if arm.mode == "server":
            run.sandboxes["starts"] = self.stats.sandboxes_started(arm) - sandboxes_before
        if arm.mode != "nocache":
            run.service = self.stats.epoch(arm, epoch)
        return run
