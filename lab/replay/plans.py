"""What every arm of a replay issues: each task's rollouts per epoch, their step labels and, under
faults, the rollout's fault, with the faults that are part of the world applied to its calls."""

from __future__ import annotations

from collections import Counter

from .arms import Arm
from .faults import Fault, FaultPlan
from .workload import Call, ReplayTask, Workload


class RolloutPlans:
    def __init__(
        self, workload: Workload, tasks: list[ReplayTask], arms: list[Arm], epochs: int, faults: FaultPlan | None
    ):
        self.workload = workload
        self.arms = arms
        self.faults = faults
        self.planned: dict[str, Counter[str]] = {arm.name: Counter() for arm in arms}  # faults per arm and kind
        self._faults: dict[tuple[str, int, int], Fault | None] = {}
        self._steps: dict[tuple[str, int], list[list[str | None]]] = {}
        self.calls = {(task.name, epoch): self._plan(task, epoch) for epoch in range(epochs) for task in tasks}

    def _plan(self, task: ReplayTask, epoch: int) -> list[list[Call]]:
        rollouts = self.workload.rollouts(task, epoch)
        steps = self.workload.steps(task, epoch)
        if steps is not None:  # a fault changes a call in place: the labels keep their positions
            self._steps[(task.name, epoch)] = steps
        if self.faults is None:
            return rollouts
        out = []
        for index, calls in enumerate(rollouts):
            fault = self.faults.choose(self.workload, task.name, epoch, index, calls)
            self._faults[(task.name, epoch, index)] = fault
            for arm in self.arms:
                if fault is not None and fault.applies(arm.mode):
                    self.planned[arm.name][fault.kind] += 1
            out.append(self.faults.world(self.workload, calls, fault))
        return out

    def rollouts(self, task: str, epoch: int) -> list[list[Call]]:
        return self.calls[(task, epoch)]

    def step(self, task: str, epoch: int, index: int, position: int) -> str | None:
        """The workload's label of the call, None where it names none."""
        steps = self._steps.get((task, epoch))
        return steps[index][position] if steps else None

    def rollout_fault(self, task: str, epoch: int, index: int) -> Fault | None:
        """The rollout's fault, whichever arm it applies to."""
        return self._faults.get((task, epoch, index))

    def fault(self, arm: Arm, task: str, epoch: int, index: int) -> Fault | None:
        """The rollout's fault in this arm, if it meets one there."""
        fault = self.rollout_fault(task, epoch, index)
        return fault if fault is not None and fault.applies(arm.mode) else None
