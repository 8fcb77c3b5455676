"""The arms of a replay and their tasks on the service.

- `nocache`: each rollout in a fresh local sandbox of the workload, every call executed;
- `client`: tvclient's ToolCallExecutor over the same local sandboxes (client mode);
- `server`: POST .../rollouts/{id}/calls, the service runs the sandboxes (tool-server mode).
A budget suffix (`client-b8`, `server-b8`) gives the arm's tasks that snapshot budget; without
one the budget is unlimited (NO_BUDGET). Each arm has tasks of its own, so graphs never mix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tvclient import TVCacheClient

from .workload import ReplayTask

NO_BUDGET = 100_000  # live snapshots per task: in effect unlimited
MODES = ("nocache", "client", "server")


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


class ArmTasks:
    """The service's tasks of every cached arm of one run: their ids, their registration, the
    steps announced to them."""

    def __init__(self, client: TVCacheClient, run_tag: str, tasks: list[ReplayTask], arms: list[Arm]):
        self.client = client
        self.run_tag = run_tag
        self.tasks = tasks
        self.arms = arms
        self.match: str | None = None  # how the service matches the tool-server arms' tasks (as it said)

    def task_id(self, task: ReplayTask, arm: Arm) -> str:
        return f"rp-{self.run_tag}-{task.name}-{arm.name}"[:200]

    def ids(self, arm: Arm) -> list[str]:
        return [self.task_id(task, arm) for task in self.tasks]

    def server_ids(self) -> list[str]:
        """The tasks whose sandboxes the service runs (the tool-server arms')."""
        return [task_id for arm in self.arms if arm.mode == "server" for task_id in self.ids(arm)]

    def put(self, audit_rate: float | None, match: str | None = None) -> None:
        for arm in self.arms:
            if arm.mode == "nocache":
                continue
            budget = NO_BUDGET if arm.budget is None else arm.budget
            for task in self.tasks:
                env = task.client_env if arm.mode == "client" else task.server_env
                if env is None:
                    raise ValueError(f"task {task.name} cannot run in tool-server mode")
                put = self.client.put_task(
                    self.task_id(task, arm),
                    env=env,
                    tools=task.tools,
                    sandbox_budget=budget,
                    audit_rate=audit_rate,
                    match=match,
                )
                if arm.mode == "server":
                    self.match = put.get("match")

    def announce(self, arm: Arm, epoch: int, rollouts: int, warm_wait_s: float) -> float:
        """Tool-server mode: announce the step, then give the workers up to warm_wait_s to warm
        the roots and pre-forks (in training this overlaps the policy's first generation)."""
        ids = set(self.ids(arm))
        started = time.perf_counter()
        self.client.announce_step(sorted(ids), rollouts, epoch)
        deadline = started + warm_wait_s
        while time.perf_counter() < deadline:
            pools = self.client.pools()["pools"]
            if not any(pool["states"].get("warming") for pool in pools if pool["task_id"] in ids):
                break
            time.sleep(0.1)
        return time.perf_counter() - started
