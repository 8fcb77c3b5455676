"""What a workload gives the replay: its tasks and, per epoch, the seeded rollouts every arm issues."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tvclient import ToolExecutionEnvironment

from .faults import ENV_FAULTS

if TYPE_CHECKING:
    from .samples import EpochRun

Call = dict[str, Any]
VERIFY_STEP = "verify"  # the step label of a call that runs the task's verifier (Workload.steps)


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
    fault_kinds: tuple[str, ...] = ENV_FAULTS

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

    def figures(self, runs: list[EpochRun]) -> dict[str, Any]:
        """Figures of the workload's own over the run's samples, once it is over (their results
        are gone by then): the report's `workload_figures`. {}: none."""
        return {}

    def close(self) -> None:
        pass
