"""Drive a demo workload against a running service: client-mode tasks through tvclient (tools
that sleep to stand in for real ones) and, when the Docker engine is up, a tool-server task
whose bash calls run in containers the service manages. Tasks x 8 rollouts x epochs, with
branching histories."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from django.core.management.base import BaseCommand

from tvclient import FolderEnvironment, SnapshotStore, ToolCallExecutor, TVCacheClient

TOOL_MS = {"write_file": 300, "read_file": 40, "list_dir": 20}
DOCKER_TASK = "demo-docker"


class SlowFolderEnvironment(FolderEnvironment):
    """A folder environment whose tools take as long as real ones would."""

    def execute(self, call):
        time.sleep(TOOL_MS.get(call["tool"], 50) / 1000)
        return super().execute(call)


def folder_calls(task: int, rng: random.Random) -> list[dict]:
    """Setup shared by most rollouts, then a branch: different fixes with inspections between."""
    calls = [
        {"tool": "write_file", "args": {"path": "setup.cfg", "content": f"task={task}"}},
        {"tool": "list_dir", "args": {"path": "."}},
    ]
    if rng.random() < 0.8:
        calls.append({"tool": "write_file", "args": {"path": "main.py", "content": "print('v1')"}})
    for step in range(rng.randint(2, 5)):
        calls.append({"tool": "read_file", "args": {"path": rng.choice(["main.py", "setup.cfg"])}})
        fix = rng.choice(["v2", "v3"]) if step < 2 else rng.choice(["v2", "v3", "v4", "v5"])
        calls.append({"tool": "write_file", "args": {"path": "main.py", "content": f"print('{fix}')"}})
    calls.append({"tool": "read_file", "args": {"path": "main.py"}})
    return calls


def bash_calls(rng: random.Random) -> list[dict]:
    """A slow setup, then edits and inspections in a container."""

    def bash(command: str) -> dict:
        return {"tool": "bash", "args": {"command": command}}

    calls = [bash("sleep 2; mkdir -p /app && cd /app && printf 'a\\nb\\n' > data.txt"), bash("ls /app")]
    for _ in range(rng.randint(1, 3)):
        calls.append(bash(f"cd /app && echo {rng.choice(['c', 'd', 'e'])} >> data.txt"))
        calls.append(bash(rng.choice(["cat /app/data.txt", "wc -l /app/data.txt"])))
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
        client = TVCacheClient(url, token, timeout=300)
        snapshots = SnapshotStore()
        task_ids = [f"demo-{index}" for index in range(tasks)]
        for task_id in task_ids:
            client.put_task(
                task_id,
                env={"backend": "external", "demo": task_id},
                tools={
                    "read_file": {"mutates_state": False, "cacheable": True},
                    "list_dir": {"mutates_state": False, "cacheable": True},
                },
                sandbox_budget=8,
            )
        if client.pools()["engine"]["ok"]:
            client.put_task(DOCKER_TASK, env={"backend": "docker"}, sandbox_budget=8)
            task_ids.append(DOCKER_TASK)
        else:
            self.stdout.write("no Docker engine: the tool-server demo task is left out")
        # A rerun against the same service goes on where the last one stopped: new epochs, so new
        # rollout ids, and the graphs built so far serve it from the start.
        first = 1 + max((row["epoch"] for t in task_ids for row in client.stats(t)["per_epoch"]), default=-1)
        for epoch in range(first, first + epochs):
            started = time.perf_counter()
            if DOCKER_TASK in task_ids:
                client.announce_step([DOCKER_TASK], rollouts, epoch)
            jobs = [(task_id, r) for task_id in task_ids for r in range(rollouts)]
            with ThreadPoolExecutor(max_workers=rollouts) as pool:
                list(pool.map(lambda job: self._rollout(client, snapshots, job, epoch, seed), jobs))
            rates = [
                next(row["hit_rate"] for row in client.stats(t)["per_epoch"] if row["epoch"] == epoch) for t in task_ids
            ]
            self.stdout.write(
                f"epoch {epoch}: {time.perf_counter() - started:.1f}s, hit rate "
                + ", ".join(f"{t} {rate:.0%}" for t, rate in zip(task_ids, rates))
            )
        snapshots.close()

    @staticmethod
    def _rollout(client, snapshots, job, epoch: int, seed: int) -> None:
        task_id, index = job
        rng = random.Random(f"{seed}-{task_id}-{index}-{epoch}")
        rollout_id = f"e{epoch}-r{index}"
        if task_id == DOCKER_TASK:  # tool-server mode: the service runs the calls
            for call in bash_calls(rng):
                client.call(task_id, rollout_id, call, epoch=epoch)
            client.end_rollout(task_id, rollout_id)
            return
        with ToolCallExecutor(
            client,
            task_id,
            partial(SlowFolderEnvironment, None),
            rollout_id=rollout_id,
            epoch=epoch,
            snapshots=snapshots,
        ) as executor:
            for call in folder_calls(int(task_id.split("-")[1]), rng):
                executor.execute(call)
