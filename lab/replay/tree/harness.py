"""The tree replay's loop: every epoch, every arm runs the same trees of every task, `concurrency`
trees at a time and each branch as soon as its origin opens it, beside it; then the exactness referee judges every cached answer against the no-cache arm's, which ran
each trajectory's full history (prefix and own calls) in a fresh sandbox.

TreeReplay has what report.build_report reads of a Replay (runs, config, workload, tasks,
per_tool, divergences, mismatch_examples), so a tree replay's report has every field of a flat
one, and tree/report.py adds the tree's own."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from ..arms import Arm, ArmTasks
from ..exactness import ReplayReferee, call_keys
from ..faults import FaultPlan
from ..metering import TimedClient
from ..pacing import Pacing
from ..samples import CallSample, EpochRun, RolloutSample, mark_unknown_state
from ..stats import ServiceStats
from ..workload import ReplayTask, Workload
from .drivers import Job, tree_arm
from .meters import LiveSandboxes
from .plan import Trajectory, TreePlans, TreeShape
from .samples import Opened, TrajectoryRun, TreeRun

MAX_THREADS = 4096  # in effect no bound: every trajectory of the trees in flight runs at once


@dataclass
class TreeConfig:
    epochs: int
    arms: list[Arm]
    concurrency: int  # trees in flight (all of a tree's trajectories run at once)
    seed: int
    run_tag: str
    shape: TreeShape = field(default_factory=TreeShape)
    think_ms: float = 0.0
    warm_wait_s: float = 5.0
    keep_examples: int = 5
    audit_rate: float | None = None
    faults: FaultPlan | None = None  # always None: report.build_report reads it


class Trajectories:
    """Runs trees, `trees` at a time, every trajectory of a tree as soon as it is added: tree
    search runs a branch point's continuations together, and a branch kept waiting for a worker
    would hold a tool-server sandbox made at the request. `join` returns once every trajectory
    added has run, and raises what one raised."""

    def __init__(self, trees: int):
        self._pool = ThreadPoolExecutor(max_workers=MAX_THREADS, thread_name_prefix="tree")
        self._trees = threading.Semaphore(trees)
        self._lock = threading.Lock()
        self._futures: list[Future] = []
        self._running: dict[str, int] = {}  # per tree: its trajectories added and not over
        self._failed = threading.Event()

    def add_tree(self, tree: str, fn, *args) -> None:
        """Once fewer than `trees` trees run (none more after a trajectory failed)."""
        self._trees.acquire()
        if self._failed.is_set():
            self._trees.release()
            return
        self.add(tree, fn, *args)

    def add(self, tree: str, fn, *args) -> None:
        with self._lock:
            self._running[tree] = self._running.get(tree, 0) + 1
            self._futures.append(self._pool.submit(self._run, tree, fn, *args))

    def _run(self, tree: str, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException:
            self._failed.set()
            raise
        finally:
            # A trajectory adds its branches before it ends: its tree is over when none runs.
            with self._lock:
                self._running[tree] -= 1
                over = self._running[tree] == 0
            if over:
                self._trees.release()

    def join(self) -> None:
        # Once the futures before index i are done, every future there will be is in the list.
        index = 0
        try:
            while True:
                with self._lock:
                    if index == len(self._futures):
                        return
                    future = self._futures[index]
                future.result()
                index += 1
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)


def tree_of(task: ReplayTask, trajectory: Trajectory) -> str:
    """The tree a trajectory belongs to: its task and root."""
    return f"{task.name}/{trajectory.id.split('.')[0]}"


class TreeReplay:
    def __init__(self, workload: Workload, client: TimedClient, config: TreeConfig, progress_stream=None):
        self.workload = workload
        self.client = client
        self.config = config
        self.tasks = workload.tasks()
        self.plans = TreePlans(workload, self.tasks, config.epochs, config.shape, config.seed)
        self.arm_tasks = ArmTasks(client, config.run_tag, self.tasks, config.arms)
        self.pacing = Pacing(config.seed, config.think_ms)
        self.referee = ReplayReferee(self.tasks, self.plans, self.pacing, config.keep_examples)
        self.stats = ServiceStats(client, self.arm_tasks)
        self.drivers = {
            arm.name: tree_arm(
                arm, client=client, arm_tasks=self.arm_tasks, miss_penalty_ms=workload.server_miss_penalty_ms
            )
            for arm in config.arms
        }
        self.runs: list[EpochRun] = []
        self.trees: list[TreeRun] = []
        self.per_tool: dict[str, list[dict[str, Any]]] = {}
        self.divergences: dict[str, dict[str, int] | None] = {}
        self._progress_stream = progress_stream

    @property
    def mismatch_examples(self) -> list[dict[str, Any]]:
        return self.referee.examples

    def run(self) -> list[EpochRun]:
        self.arm_tasks.put(self.config.audit_rate)
        total = sum(len(t) for t in self.plans.trajectories.values()) * len(self.config.arms)
        progress = tqdm(
            total=total,
            unit="trajectory",
            file=self._progress_stream or sys.stderr,
            mininterval=0.2,
            dynamic_ncols=True,
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
            for driver in self.drivers.values():
                driver.close()
        return self.runs

    def _run_epoch(self, arm: Arm, epoch: int, progress: tqdm) -> EpochRun:
        run, tree = EpochRun(arm=arm.name, epoch=epoch), TreeRun(arm=arm.name, epoch=epoch)
        driver = self.drivers[arm.name]
        live = LiveSandboxes(self.client, self.arm_tasks.ids(arm)) if arm.mode == "server" else None
        started = time.perf_counter()
        if live is not None:
            live.start()
            roots = max(len(self.plans.roots[(task.name, epoch)]) for task in self.tasks)
            run.warm_wait_s = self.arm_tasks.announce(arm, epoch, roots, self.config.warm_wait_s)
            sandboxes_before = self.stats.sandboxes_started(arm)
        done: dict[tuple[str, str], TrajectoryRun] = {}
        lock = threading.Lock()
        trajectories = Trajectories(self.config.concurrency)

        def one(task: ReplayTask, trajectory: Trajectory, opened: Opened | None) -> None:
            think = self.pacing.thinking(task.name, epoch, trajectory.index, len(trajectory.calls))
            outcome = driver.run(
                Job(
                    task,
                    epoch,
                    trajectory,
                    think,
                    opened,
                    lambda child, how: trajectories.add(tree_of(task, trajectory), one, task, child, how),
                )
            )
            mark_unknown_state(outcome.samples)
            with lock:
                done[(task.name, trajectory.id)] = outcome
                progress.set_description(f"epoch {epoch} {arm.name}", refresh=False)
                progress.update()

        for task in self.tasks:
            for root in self.plans.roots[(task.name, epoch)]:
                trajectories.add_tree(tree_of(task, root), one, task, root, None)
        trajectories.join()
        run.step_s = tree.wall_s = time.perf_counter() - started
        if live is not None:
            tree.sandbox_s, tree.sandbox_s_measured = live.stop(), "sampled"
            tree.sandbox_s_by_state = live.by_state
        else:
            (tree.sandbox_s, tree.sandboxes), tree.sandbox_s_measured = driver.lifetimes.take(), "lifetimes"
        self._gather(run, tree, epoch, done)
        run.sandboxes = driver.counts.take()
        if arm.mode == "server":
            run.sandboxes["starts"] = self.stats.sandboxes_started(arm) - sandboxes_before
        if arm.mode != "nocache":
            run.service = self.stats.epoch(arm, epoch)
        self.trees.append(tree)
        return run

    def _gather(self, run: EpochRun, tree: TreeRun, epoch: int, done: dict[tuple[str, str], TrajectoryRun]) -> None:
        """The epoch's samples in the runs, keyed as the service keys them along each full history."""
        for task in self.tasks:
            paths: dict[str, list[CallSample]] = {}
            for trajectory in self.plans.trajectories[(task.name, epoch)]:  # an origin before its branches
                outcome = done.get((task.name, trajectory.id))
                parent = trajectory.parent
                if outcome is None or (parent is not None and parent.id not in paths):
                    continue
                prefix = paths[parent.id][: len(trajectory.prefix)] if parent is not None else []
                paths[trajectory.id] = path = prefix + outcome.samples
                keys = call_keys(task, path, trajectory.history[: len(path)])[len(prefix) :]
                for sample, key in zip(outcome.samples, keys):
                    sample.key = key
                run.calls.extend(outcome.samples)
                run.rollouts.append(RolloutSample(task.name, trajectory.index, outcome.seconds, len(outcome.samples)))
                tree.requests.extend(outcome.requests)
                if outcome.ready is not None:
                    tree.branches.append(outcome.ready)
                tree.trajectories += 1
                tree.levels[trajectory.level] = tree.levels.get(trajectory.level, 0) + 1
                tree.held_ms.extend(s.latency_ms for s, held in zip(outcome.samples, outcome.held) if held)
