"""How each arm runs one rollout: its calls in order, each after the policy's thinking, measured
as CallSamples. Under faults the rollout meets its fault here (faults.py)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from tvclient import SnapshotStore, ToolCallExecutor, ToolExecutionEnvironment, TVCacheClient

from .arms import Arm, ArmTasks
from .faults import ENV_FAULTS, Fault, kill_rollout_sandbox, timed_out
from .metering import MeteredEnvironment, SandboxCounts, meter
from .restarts import send
from .samples import CallSample, digest
from .workload import Call, ReplayTask


class ArmRollouts(ABC):
    """One arm's rollouts; `counts` meters the local sandboxes they use."""

    def __init__(self, arm: Arm, on_call: Callable[[], None]):
        self.arm = arm
        self.counts = SandboxCounts()
        self._on_call = on_call  # a call was answered (the restart counts them)

    @abstractmethod
    def run(
        self, task: ReplayTask, epoch: int, index: int, calls: list[Call], think: list[float], fault: Fault | None
    ) -> list[CallSample]:
        """The rollout's samples, a call each; `think`: seconds before each call (pacing.py)."""

    def close(self) -> None:
        pass

    def _sample(self, task, epoch, index, position, call, latency_ms, cached, env_ms, result) -> CallSample:
        self._on_call()
        return CallSample(
            task.name,
            epoch,
            index,
            position,
            call["tool"],
            latency_ms,
            cached,
            env_ms,
            digest(result),
            result=result,
            started=time.perf_counter() - latency_ms / 1000,
        )


class NocacheRollouts(ArmRollouts):
    """Each rollout in a fresh local sandbox of the workload, every call executed."""

    def run(self, task, epoch, index, calls, think, fault=None) -> list[CallSample]:
        samples = []
        env = MeteredEnvironment(task.make_env(), self.counts)
        meter.env_ms = 0.0
        env.start()  # counted in the rollout's time, not in its first call's latency
        try:
            for position, call in enumerate(calls):
                time.sleep(think[position])
                meter.env_ms = 0.0
                started = time.perf_counter()
                result = env.execute(call)
                latency = (time.perf_counter() - started) * 1000
                samples.append(self._sample(task, epoch, index, position, call, latency, None, meter.env_ms, result))
        finally:
            env.stop()
        return samples


class ClientRollouts(ArmRollouts):
    """Client mode: tvclient's ToolCallExecutor over the workload's local sandboxes."""

    def __init__(
        self, arm: Arm, on_call: Callable[[], None], *, client: TVCacheClient, arm_tasks: ArmTasks, again: bool
    ):
        super().__init__(arm, on_call)
        self.client = client
        self.arm_tasks = arm_tasks
        self.again = again  # send a request the service did not answer again (under faults)
        self.snapshots = SnapshotStore()

    def close(self) -> None:
        self.snapshots.close()

    def run(self, task, epoch, index, calls, think, fault) -> list[CallSample]:
        samples = []
        counts = self.counts

        def factory() -> ToolExecutionEnvironment:
            return MeteredEnvironment(task.make_env(), counts)

        with ToolCallExecutor(
            self.client,
            self.arm_tasks.task_id(task, self.arm),
            factory,
            rollout_id=f"e{epoch}-r{index}",
            epoch=epoch,
            snapshots=self.snapshots,
        ) as executor:
            for position, call in enumerate(calls):
                time.sleep(think[position])
                meter.env_ms = meter.lookup_ms = meter.lookup_server_ms = 0.0
                armed = fault is not None and fault.kind in ENV_FAULTS and fault.position == position
                meter.armed, meter.fired = ((fault.kind, call) if armed else None), False
                hits, keyed, waited_ms = executor.hits, len(executor.history), executor.background_wait_ms
                started = time.perf_counter()
                try:
                    result, retries, failed, sent = self._execute(executor, call)
                finally:
                    meter.armed = None
                latency = (time.perf_counter() - started) * 1000
                sample = self._sample(
                    task, epoch, index, position, call, latency, executor.hits > hits, meter.env_ms, result
                )
                sample.started = sent
                sample.lookup_ms, sample.lookup_server_ms = meter.lookup_ms, meter.lookup_server_ms
                sample.background_wait_ms = executor.background_wait_ms - waited_ms
                # Left out of the history: read-only. A call the environment failed after ran, and
                # a rollout off the shared graph keeps no history: those are keyed as the tool's
                # policy says.
                detached = getattr(executor, "detached", False)
                # A fault that fired on a hit fired in its audit's re-execution (a sampled hit run
                # again in the open environment): the answer is the cache's, and the executor
                # dropped the environment, so the rollout's state is known.
                fired = meter.fired and not sample.cached
                sample.mutates = None if fired or failed or detached else len(executor.history) > keyed
                sample.injected, sample.failed, sample.retries = fired, failed, retries
                sample.fault = fault.kind if fired else ("timeout" if timed_out(result) and not sample.cached else None)
                samples.append(sample)
            meter.env_ms = 0.0
        return samples

    def _execute(self, executor: ToolCallExecutor, call: Call) -> tuple[Any, int, bool, float]:
        """The executor's answer, the times the call was sent again, whether it got none and
        when it was last sent. An injected environment fault is the answer; a failed lookup or
        replay record (the service restarting) leaves the executor where it was, so the call is
        sent again."""

        def execute() -> Any:
            try:
                return executor.execute(call)
            except Exception as exc:
                if meter.fired:  # the environment ran the call, then failed
                    return {"error": f"{type(exc).__name__}: {exc}"}
                raise

        result, retries, error, sent = send(execute, again=self.again)
        return (result, retries, False, sent) if error is None else ({"error": error}, retries, True, sent)


class ServerRollouts(ArmRollouts):
    """Tool-server mode: POST .../rollouts/{id}/calls, the service runs the sandboxes."""

    def __init__(
        self,
        arm: Arm,
        on_call: Callable[[], None],
        *,
        client: TVCacheClient,
        arm_tasks: ArmTasks,
        again: bool,
        miss_penalty_ms: float,
    ):
        super().__init__(arm, on_call)
        self.client = client
        self.arm_tasks = arm_tasks
        self.again = again  # send a request the service did not answer again (under faults)
        self.miss_penalty_s = miss_penalty_ms / 1000  # Workload.server_miss_penalty_ms

    def run(self, task, epoch, index, calls, think, fault) -> list[CallSample]:
        samples = []
        task_id, rollout_id = self.arm_tasks.task_id(task, self.arm), f"e{epoch}-r{index}"
        death = fault.position if fault is not None and fault.kind == "sandbox_death" else None
        try:
            for position, call in enumerate(calls):
                time.sleep(think[position])
                killed = None
                if death is not None and position >= death:
                    # The first time it has one (the service says which, even while it restarts).
                    killed = send(lambda: kill_rollout_sandbox(self.client, task_id, rollout_id), again=self.again)[0]
                    death = None if killed else death
                started = time.perf_counter()
                answer, retries, error, sent = send(
                    lambda: self.client.call(task_id, rollout_id, call, epoch=epoch), again=self.again
                )
                if answer is not None and not answer.cached and self.miss_penalty_s:
                    time.sleep(self.miss_penalty_s)
                latency = (time.perf_counter() - started) * 1000
                result = answer.result if answer is not None else {"error": error}
                sample = self._sample(
                    task,
                    epoch,
                    index,
                    position,
                    call,
                    latency,
                    answer.cached if answer is not None else False,
                    None,
                    result,
                )
                sample.mutates = answer.mutates if answer is not None else None
                if answer is not None and not answer.cached:
                    sample.phases_ms = dict(answer.phases_ms)
                sample.failed, sample.retries, sample.started = answer is None, retries, sent
                sample.fault = (
                    "sandbox_death" if killed else ("timeout" if timed_out(result) and not sample.cached else None)
                )
                samples.append(sample)
        finally:
            send(lambda: self.client.end_rollout(task_id, rollout_id), again=self.again)
        return samples


def arm_rollouts(
    arm: Arm,
    on_call: Callable[[], None],
    *,
    client: TVCacheClient,
    arm_tasks: ArmTasks,
    again: bool,
    miss_penalty_ms: float,
) -> ArmRollouts:
    if arm.mode == "nocache":
        return NocacheRollouts(arm, on_call)
    if arm.mode == "client":
        return ClientRollouts(arm, on_call, client=client, arm_tasks=arm_tasks, again=again)
    return ServerRollouts(
        arm, on_call, client=client, arm_tasks=arm_tasks, again=again, miss_penalty_ms=miss_penalty_ms
    )
