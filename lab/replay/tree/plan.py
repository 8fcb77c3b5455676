"""The trees a tree replay runs, the same in every arm: per task and epoch, the workload's rollouts
are the roots, and each trajectory above the last level branches once into `count` continuations.

A trajectory branches after `at` of its own calls (`TreeShape.at`, per level) or after a seeded
number of them: 1 to all but the last (so that it goes on too), and no further than the median
draw below reaches (so that most draws can continue from there). Each continuation is the policy
sampled again from there: the suffix, from the branch point's position in the full history, of a
rollout the workload draws for an epoch no replay runs (BRANCH_EPOCH on), seeded per branch, and
different from the origin's own continuation and its siblings' where the draws allow it. Calls keep
their positions: a terminal continuation taken in the setup finishes the setup (a variant of it
sometimes) then repairs; a sql one asks the rest of another rollout's queries.

A trajectory's history is its prefix (the calls of its origin up to the branch point, the
origin's prefix included) then its own calls; `TreePlans.rollouts` gives them by trajectory index,
which is what the exactness referee re-executes (exactness.ReplayReferee)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..workload import Call, ReplayTask, Workload

BRANCH_EPOCH = 1_000_000  # continuations are drawn from the workload's rollouts of epochs from here on
BRANCH_EPOCHS = 16  # ... of this many of them
DRAWS = 64  # draws per continuation before one that repeats another is taken


@dataclass(frozen=True)
class TreeShape:
    count: int = 4  # continuations per branch point
    depth: int = 2  # levels of branches below the roots
    at: tuple[int, ...] = ()  # own calls before each level's branch point (the last repeats); (): seeded

    def describe(self) -> dict[str, Any]:
        return {"count": self.count, "depth": self.depth, "at": list(self.at) or "seeded"}


@dataclass(eq=False)
class Trajectory:
    id: str  # r<root>, then .<branch> per level: r0.2.1
    index: int  # in its task and epoch: the referee's rollout number
    level: int  # 0 for a root
    prefix: tuple[Call, ...]  # its origin's calls up to the branch point
    calls: list[Call]  # its own
    parent: Trajectory | None = None
    branch_at: int | None = None  # it branches after this many of its own calls (None: never)
    children: list[Trajectory] = field(default_factory=list)

    @property
    def history(self) -> list[Call]:
        return [*self.prefix, *self.calls]

    def rollout_id(self, epoch: int) -> str:
        return f"e{epoch}-{self.id}"

    def walk(self) -> Iterator[Trajectory]:
        yield self
        for child in self.children:
            yield from child.walk()


class TreePlans:
    """Every task's trees per epoch. Also the plans the exactness referee reads (plans.RolloutPlans'
    `rollouts`, `rollout_fault`, `faults`), with a trajectory for each rollout."""

    faults = None  # the tree replay meets no planned faults

    def __init__(self, workload: Workload, tasks: list[ReplayTask], epochs: int, shape: TreeShape, seed: int):
        self.workload = workload
        self.shape = shape
        self.seed = seed
        self._draws: dict[tuple[str, int], list[list[Call]]] = {}
        self.trajectories: dict[tuple[str, int], list[Trajectory]] = {}
        self.roots: dict[tuple[str, int], list[Trajectory]] = {}
        for epoch in range(epochs):
            for task in tasks:
                grown: list[Trajectory] = []
                self.roots[(task.name, epoch)] = [
                    self._grow(task, epoch, Trajectory(f"r{i}", len(grown), 0, (), calls), grown)
                    for i, calls in enumerate(workload.rollouts(task, epoch))
                ]
                self.trajectories[(task.name, epoch)] = grown
        self._histories = {key: [t.history for t in trajs] for key, trajs in self.trajectories.items()}

    def rollouts(self, task: str, epoch: int) -> list[list[Call]]:
        """Each trajectory's full history, by index."""
        return self._histories[(task, epoch)]

    def rollout_fault(self, task: str, epoch: int, index: int) -> None:
        return None

    def _grow(self, task: ReplayTask, epoch: int, trajectory: Trajectory, grown: list[Trajectory]) -> Trajectory:
        grown.append(trajectory)
        if trajectory.level >= self.shape.depth or not trajectory.calls:
            return trajectory
        trajectory.branch_at = self._branch_at(task, epoch, trajectory)
        prefix = (*trajectory.prefix, *trajectory.calls[: trajectory.branch_at])
        taken = [trajectory.calls[trajectory.branch_at :]]
        for j in range(self.shape.count):
            child_id = f"{trajectory.id}.{j}"
            calls = self._continuation(task, epoch, child_id, len(prefix), taken)
            taken.append(calls)
            child = Trajectory(child_id, len(grown), trajectory.level + 1, prefix, calls, parent=trajectory)
            trajectory.children.append(child)
            self._grow(task, epoch, child, grown)
        return trajectory

    def _branch_at(self, task: ReplayTask, epoch: int, trajectory: Trajectory) -> int:
        last = len(trajectory.calls)
        if self.shape.at:
            return max(1, min(last, self.shape.at[min(trajectory.level, len(self.shape.at) - 1)]))
        # Up to the median draw's last call, so that most draws can continue from the point.
        lengths = sorted(len(d) for e in range(BRANCH_EPOCHS) for d in self._drawn(task, e))
        room = lengths[len(lengths) // 2] - 1 - len(trajectory.prefix) if lengths else last
        rng = random.Random(f"{self.seed}-branch-at-{task.name}-{epoch}-{trajectory.id}")
        return rng.randint(1, max(1, min(last - 1, room)))

    def _continuation(self, task: ReplayTask, epoch: int, child_id: str, position: int, taken: list) -> list[Call]:
        """The suffix from `position` of a seeded draw of the policy, unlike those `taken` if a draw
        allows; the last call of the longest draw when no draw is that long."""
        rng = random.Random(f"{self.seed}-continuation-{task.name}-{epoch}-{child_id}")
        repeat: list[Call] | None = None
        for _ in range(DRAWS):
            draws = self._drawn(task, rng.randrange(BRANCH_EPOCHS))
            rest = rng.choice(draws)[position:] if draws else []
            if rest and rest not in taken:
                return rest
            repeat = repeat or rest or None
        if repeat is not None:
            return repeat
        longest = max((d for e in range(BRANCH_EPOCHS) for d in self._drawn(task, e)), key=len)
        return longest[-1:]

    def _drawn(self, task: ReplayTask, draw_epoch: int) -> list[list[Call]]:
        key = (task.name, draw_epoch)
        if key not in self._draws:
            self._draws[key] = self.workload.rollouts(task, BRANCH_EPOCH + draw_epoch)
        return self._draws[key]
