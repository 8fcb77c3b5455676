"""Drive a demo workload through tvclient in client mode: tasks x 8 rollouts x epochs, with
branching histories, against a running service. Tool calls sleep to stand in for real tools."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from django.core.management.base import BaseCommand
from tvclient import FolderEnvironment, SnapshotStore, TVCacheClient, ToolCallExecutor

TOOL_MS = {"write_file": 300, "read_file": 40, "list_dir": 20}


class SlowFolderEnvironment(FolderEnvironment):
    """A folder environment whose tools take as long as real ones would."""

    def execute(self, call):
        time.sleep(TOOL_MS.get(call["tool"], 50) / 1000)
        return super().execute(call)


def rollout_calls(task: int, rng: random.Random) -> list[dict]:
    """Setup shared by most rollouts, then a branch: different fixes with inspections between."""
    calls = [{"tool": "write_file", "args": {"path": "setup.cfg", "content": f"task={task}"}},
             {"tool": "list_dir", "args": {"path": "."}}]
    if rng.random() < 0.8:
        calls.append({"tool": "write_file", "args": {"path": "main.py", "content": "print('v1')"}})
    for step in range(rng.randint(2, 5)):
        calls.append({"tool": "read_file", "args": {"path": rng.choice(["main.py", "setup.cfg"])}})
        fix = rng.choice(["v2", "v3"]) if step < 2 else rng.choice(["v2", "v3", "v4", "v5"])
        calls.append({"tool": "write_file", "args": {"path": "main.py", "content": f"print('{fix}')"}})
    calls.append({"tool": "read_file", "args": {"path": "main.py"}})
    return calls


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser):
        parser.add_argument("--url", default="http://127.0.0.1:8000")
        parser.add_argument("--token", required=True)
        parser.add_argument("--tasks", type=int, default=3)
        parser.add_argument("--rollouts", type=int, default=8)
        parser.add_argument("--epochs", type=int, default=3)
        parser.add_argument("--seed", type=int, default=1)

    def handle(self, *args, url, token, tasks, rollouts, epochs, seed, **options):
        client = TVCacheClient(url, token)
        snapshots = SnapshotStore()
        task_ids = [f"demo-{index}" for index in range(tasks)]
        for task_id in task_ids:
            client.put_task(task_id, env={"backend": "external", "demo": task_id},
                            tools={"read_file": {"mutates_state": False, "cacheable": True},
                                   "list_dir": {"mutates_state": False, "cacheable": True}}, sandbox_budget=8)
        for epoch in range(epochs):
            started = time.perf_counter()
            jobs = [(task, r) for task in range(tasks) for r in range(rollouts)]
            with ThreadPoolExecutor(max_workers=rollouts) as pool:
                list(pool.map(lambda job: self._rollout(client, snapshots, job, epoch, seed), jobs))
            rates = [client.stats(t)["per_epoch"][-1]["hit_rate"] for t in task_ids]
            self.stdout.write(f"epoch {epoch}: {time.perf_counter() - started:.1f}s, hit rate per task "
                              + ", ".join(f"{rate:.0%}" for rate in rates))
        snapshots.close()

    @staticmethod
    def _rollout(client, snapshots, job, epoch: int, seed: int) -> None:
        task, index = job
        rng = random.Random(seed * 1_000_003 + task * 1009 + index * 31 + epoch)
        with ToolCallExecutor(client, f"demo-{task}", partial(SlowFolderEnvironment, None),
                              rollout_id=f"e{epoch}-r{index}", epoch=epoch, snapshots=snapshots) as executor:
            for call in rollout_calls(task, rng):
                executor.execute(call)
