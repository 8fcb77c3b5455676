"""When a rollout's calls are sent: the policy's thinking before each one, and the paces of the
fresh executions that try to reproduce an answer. Pacing is not part of a history: the calls are
the same at any pace, which is why a second live outcome found at another pace counts apart
(exactness/)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Pacing:
    seed: int
    think_ms: float = 0.0  # the policy's generation time before each call (mean)

    def thinking(self, task: str, epoch: int, index: int, calls: int) -> list[float]:
        """Seconds the policy generates before each call: 0.5x to 1.5x the mean, seeded per
        rollout, the same in every arm. Real rollouts are not back to back: without it the
        rollouts are a closed-loop load generator and the service is measured saturated."""
        mean_s = self.think_ms / 1000
        rng = random.Random(f"{self.seed}-think-{task}-{epoch}-{index}")
        return [mean_s * rng.uniform(0.5, 1.5) for _ in range(calls)]

    def reproduction(self, task: str, rollout: int, position: int) -> list[Callable[[], float]]:
        """The paces of the fresh executions that try to reproduce the answer of one call, used in
        turn, each giving the seconds before a call: back to back, at the thinking time, and with
        up to 1.5 s between calls. Seeded per call."""
        rng = random.Random(f"{self.seed}-reproduce-{task}-{rollout}-{position}")
        return [lambda: 0.0, lambda: self.think_ms / 1000 * rng.uniform(0.5, 1.5), lambda: rng.uniform(0, 1.5)]
