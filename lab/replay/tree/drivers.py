"""How each arm runs one trajectory of a tree: its own calls in order, each after the policy's
thinking, and at its branch point the branches, handed to the harness to run beside it.

- `nocache`: every trajectory in a fresh local sandbox; a branch first replays, back to back, its
  prefix's calls that the task's tools declare state-changing (what a trainer knows without a
  cache; a terminal `bash` call always is), then runs its own.
- `client`: tvclient's ToolCallExecutor; a branch is `ToolCallExecutor.branch(n)` at the branch
  point, and its environment is opened by its first miss (a fork of the nearest snapshot the
  process holds, else a fresh one, then a replay).
- `server`: POST .../rollouts/{id}/calls; a branch is POST .../branches from the origin's rollout
  at its state-changing calls so far, answered once each branch has a sandbox in that state.
"""

from __future__ import annotations

import contextlib
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from cache.tcg import TaskPolicy
from tvclient import SnapshotStore, ToolCallExecutor, TVCacheError

from ..arms import Arm, ArmTasks
from ..metering import SandboxCounts, TimedClient, meter
from ..samples import CallSample, digest
from ..workload import Call, ReplayTask
from .meters import Lifetimes, LiveEnvironment, call_meter
from .plan import Trajectory
from .samples import BranchReady, BranchRequest, Opened, TrajectoryRun


@dataclass
class Job:
    task: ReplayTask
    epoch: int
    trajectory: Trajectory
    think: list[float]  # seconds before each own call (pacing.py)
    opened: Opened | None  # None for a root
    spawn: Callable[[Trajectory, Opened], None]  # run a branch beside this trajectory


class TreeArm(ABC):
    """One arm's trajectories; `counts` and `lifetimes` meter the local sandboxes they use."""

    def __init__(self, arm: Arm):
        self.arm = arm
        self.counts = SandboxCounts()
        self.lifetimes = Lifetimes()

    def close(self) -> None:
        pass

    def run(self, job: Job) -> TrajectoryRun:
        trajectory = job.trajectory
        out = TrajectoryRun(trajectory, [], 0.0)
        started = time.perf_counter()
        with self._rollout(job) as rollout:
            for position, call in enumerate(trajectory.calls):
                if position == trajectory.branch_at:
                    out.requests.append(self._branch(job, rollout))
                time.sleep(job.think[position])
                call_meter.opened = call_meter.executed = 0
                sample, held = self._call(job, rollout, position, call)
                out.samples.append(sample)
                out.held.append(held)
            if trajectory.branch_at == len(trajectory.calls):
                out.requests.append(self._branch(job, rollout))
        out.seconds = time.perf_counter() - started
        opened = job.opened
        if opened is not None and out.samples and opened.ready_ms is not None:
            first = out.samples[0]
            out.ready = BranchReady(
                job.task.name,
                job.epoch,
                trajectory.id,
                opened.origin,
                opened.prefix_calls,
                opened.step,
                opened.ready_ms,
                first.latency_ms,
                first.cached,
                opened.service_ready_ms,
                opened.materialized,
                sum(1 for s in out.samples if not s.cached),
            )
        return out

    @abstractmethod
    def _rollout(self, job: Job) -> contextlib.AbstractContextManager[Any]:
        """The trajectory's handle while it runs (a sandbox, an executor, its history)."""

    @abstractmethod
    def _call(self, job: Job, rollout: Any, position: int, call: Call) -> tuple[CallSample, bool | None]:
        """The call's sample, and whether it ran as one execution in a sandbox the trajectory held."""

    @abstractmethod
    def _branch(self, job: Job, rollout: Any) -> BranchRequest:
        """Open the trajectory's branches here and spawn them."""

    def _request(self, job: Job, step: int | None) -> BranchRequest:
        trajectory = job.trajectory
        return BranchRequest(
            job.task.name,
            job.epoch,
            trajectory.id,
            len(trajectory.prefix) + (trajectory.branch_at or 0),
            step,
            len(trajectory.children),
        )

    @staticmethod
    def _sample(job: Job, position: int, call: Call, latency_ms: float, cached, env_ms, result) -> CallSample:
        trajectory = job.trajectory
        return CallSample(
            job.task.name,
            job.epoch,
            trajectory.index,
            len(trajectory.prefix) + position,
            call["tool"],
            latency_ms,
            cached,
            env_ms,
            digest(result),
            result=result,
            started=time.perf_counter() - latency_ms / 1000,
        )


class NocacheTree(TreeArm):
    @contextlib.contextmanager
    def _rollout(self, job: Job) -> Iterator[LiveEnvironment]:
        env = LiveEnvironment(job.task.make_env(), self.counts, self.lifetimes)
        started = time.perf_counter()
        try:
            env.start()
            if job.opened is not None:
                policy = TaskPolicy.from_json(job.task.tools)
                for call in job.trajectory.prefix:
                    if policy.for_tool(call["tool"]).mutates_state:
                        env.execute(call)
                job.opened.ready_ms = (time.perf_counter() - started) * 1000
            yield env
        finally:
            env.stop()

    def _call(self, job, env, position, call):
        meter.env_ms = 0.0
        started = time.perf_counter()
        result = env.execute(call)
        latency = (time.perf_counter() - started) * 1000
        return self._sample(job, position, call, latency, None, meter.env_ms, result), True

    def _branch(self, job, env) -> BranchRequest:
        for child in job.trajectory.children:
            job.spawn(child, Opened(job.trajectory.id, len(child.prefix), None))
        return self._request(job, None)


class ClientTree(TreeArm):
    def __init__(self, arm: Arm, *, client: TimedClient, arm_tasks: ArmTasks):
        super().__init__(arm)
        self.client = client
        self.arm_tasks = arm_tasks
        self.snapshots = SnapshotStore()

    def close(self) -> None:
        self.snapshots.close()

    def _rollout(self, job: Job) -> ToolCallExecutor:
        if job.opened is not None:
            return job.opened.handle
        task, counts, lifetimes = job.task, self.counts, self.lifetimes
        return ToolCallExecutor(
            self.client,
            self.arm_tasks.task_id(task, self.arm),
            lambda: LiveEnvironment(task.make_env(), counts, lifetimes),
            rollout_id=job.trajectory.rollout_id(job.epoch),
            epoch=job.epoch,
            snapshots=self.snapshots,
        )

    def _call(self, job, executor: ToolCallExecutor, position, call):
        meter.env_ms = meter.lookup_ms = meter.lookup_server_ms = 0.0
        hits, keyed, waited_ms = executor.hits, len(executor.history), executor.background_wait_ms
        started = time.perf_counter()
        result = executor.execute(call)
        latency = (time.perf_counter() - started) * 1000
        cached = executor.hits > hits
        sample = self._sample(job, position, call, latency, cached, meter.env_ms, result)
        sample.lookup_ms, sample.lookup_server_ms = meter.lookup_ms, meter.lookup_server_ms
        sample.background_wait_ms = executor.background_wait_ms - waited_ms
        sample.mutates = None if executor.detached else len(executor.history) > keyed
        return sample, not cached and call_meter.opened == 0 and call_meter.executed == 1

    def _branch(self, job, executor: ToolCallExecutor) -> BranchRequest:
        children = job.trajectory.children
        request = self._request(job, len(executor.history))
        started = time.perf_counter()
        try:
            branches = executor.branch(len(children), rollout_ids=[c.rollout_id(job.epoch) for c in children])
        except RuntimeError as exc:  # the rollout is detached: its state is unknown
            request.error = {"error": str(exc)}
            return request
        request.request_ms = (time.perf_counter() - started) * 1000
        for child, branch in zip(children, branches):
            job.spawn(
                child, Opened(job.trajectory.id, len(child.prefix), request.step, request.request_ms, handle=branch)
            )
        return request


class ServerTree(TreeArm):
    def __init__(self, arm: Arm, *, client: TimedClient, arm_tasks: ArmTasks, miss_penalty_ms: float):
        super().__init__(arm)
        self.client = client
        self.arm_tasks = arm_tasks
        self.miss_penalty_s = miss_penalty_ms / 1000  # Workload.server_miss_penalty_ms

    @contextlib.contextmanager
    def _rollout(self, job: Job) -> Iterator[list[Call]]:
        """The rollout's history as the service keeps it: its state-changing calls."""
        history = list(job.opened.handle) if job.opened is not None else []
        try:
            yield history
        finally:
            self.client.end_rollout(self.arm_tasks.task_id(job.task, self.arm), job.trajectory.rollout_id(job.epoch))

    def _call(self, job, history: list[Call], position, call):
        task_id = self.arm_tasks.task_id(job.task, self.arm)
        started = time.perf_counter()
        answer = self.client.call(task_id, job.trajectory.rollout_id(job.epoch), call, epoch=job.epoch)
        if not answer.cached and self.miss_penalty_s:
            time.sleep(self.miss_penalty_s)
        latency = (time.perf_counter() - started) * 1000
        sample = self._sample(job, position, call, latency, answer.cached, None, answer.result)
        sample.mutates = answer.mutates
        if answer.mutates:
            history.append(call)
        if answer.cached:
            return sample, False
        sample.phases_ms = dict(answer.phases_ms)
        return sample, not sample.phases_ms.get("materialize") and not sample.phases_ms.get("replay")

    def _branch(self, job, history: list[Call]) -> BranchRequest:
        trajectory, epoch = job.trajectory, job.epoch
        task_id = self.arm_tasks.task_id(job.task, self.arm)
        ids = [child.rollout_id(epoch) for child in trajectory.children]
        request = self._request(job, len(history))
        started = time.perf_counter()
        try:
            answer = self.client.branch(
                task_id, {"rollout": trajectory.rollout_id(epoch), "step": len(history)}, rollout_ids=ids, epoch=epoch
            )
        except TVCacheError as exc:
            request.error = {
                "request": _branch_body(task_id, trajectory.rollout_id(epoch), len(history), ids, epoch),
                "status": exc.status,
                "code": exc.code,
                "message": exc.message,
                "details": exc.details,
            }
            return request
        request.request_ms = (time.perf_counter() - started) * 1000
        request.node_id = answer["node_id"]
        if _canonical(answer["history"]) != _canonical(history):
            request.history_mismatch = {
                "request": _branch_body(task_id, trajectory.rollout_id(epoch), len(history), ids, epoch),
                "expected_history": history,
                "answered_history": answer["history"],
            }
        opened = {branch["rollout_id"]: branch for branch in answer["branches"]}
        missing = [rollout_id for rollout_id in ids if rollout_id not in opened]
        if missing:
            request.error = {"error": f"the answer names no branch {missing}", "answer": answer}
        for child in trajectory.children:
            branch = opened.get(child.rollout_id(epoch))
            if branch is None:
                continue
            job.spawn(
                child,
                Opened(
                    trajectory.id,
                    len(child.prefix),
                    request.step,
                    request.request_ms,
                    branch["ready_ms"],
                    branch["materialized"],
                    handle=list(answer["history"]),
                ),
            )
        return request


def _branch_body(task_id: str, rollout_id: str, step: int, ids: list[str], epoch: int) -> dict[str, Any]:
    return {
        "path": f"/api/v1/tasks/{task_id}/branches",
        "body": {"from": {"rollout": rollout_id, "step": step}, "count": len(ids), "rollout_ids": ids, "epoch": epoch},
    }


def _canonical(calls: list[Call]) -> list[str]:
    return [json.dumps(call, sort_keys=True, separators=(",", ":")) for call in calls]


def tree_arm(arm: Arm, *, client: TimedClient, arm_tasks: ArmTasks, miss_penalty_ms: float) -> TreeArm:
    if arm.mode == "nocache":
        return NocacheTree(arm)
    if arm.mode == "client":
        return ClientTree(arm, client=client, arm_tasks=arm_tasks)
    return ServerTree(arm, client=client, arm_tasks=arm_tasks, miss_penalty_ms=miss_penalty_ms)
