"""Measurements behind `manage.py bench_sandboxes` (the command only orchestrates and writes files).

Three layers, each measured the way it is used:
- the docker backend alone (cold forks, snapshot cost against size, container starts per second
  under the start limiter): `DockerBackend` objects of their own, resources labelled with a run id;
- the pool service functions in this process (hand-over of a READY pre-fork: `sandbox_acquire`
  plus attaching its handle, as a web process that did not warm it does);
- the service as deployed (uvicorn + a Celery worker on a queue of the run's own) driven over
  HTTP: first-miss latency with and without a ready pre-fork, and tool-server rollouts of seeded
  stochastic policies against the same rollouts run directly in fresh sandboxes.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from lab.figures import percentile

BENCH_LABEL = "tvcache.bench"  # on everything the backend-level measurements create


# --- figures -----------------------------------------------------------------------------------


def summary(values: list[float]) -> dict[str, Any]:
    """median / P95 / max in ms, rounded; n samples."""
    if not values:
        return {"n": 0, "median_ms": None, "p95_ms": None, "max_ms": None}
    return {
        "n": len(values),
        "median_ms": percentile(values, 50, 1),
        "p95_ms": percentile(values, 95, 1),
        "max_ms": round(max(values), 1),
    }


def timed_ms(action: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = action()
    return (time.perf_counter() - started) * 1000, value


def bash(command: str) -> dict[str, Any]:
    return {"tool": "bash", "args": {"command": command}}


# --- the docker backend alone ------------------------------------------------------------------


CALL_COMMANDS = ("true", "echo hi > f")


def call_latency(
    make_backend: Callable[[bool], Any], image: str, labels: dict[str, str], rounds: int
) -> dict[str, Any]:
    """A bash call's latency in one running sandbox, by a `docker exec` per call against the
    session agent (one per container): plain (`execute`: a replay, the no-cache arm) and observed
    (`execute_observed`: a tool-server miss, the layer listed before and after). Modes, commands
    and observation alternate call by call (the mode that goes first alternates each round), so
    load on the machine weighs on all alike; each sandbox's first call is reported apart."""
    env = {"backend": "docker", "image": image}
    sandboxes = {
        "exec": make_backend(False).start(env, labels=labels),
        "session": make_backend(True).start(env, labels=labels),
    }
    figures: dict[str, dict[str, list[float]]] = {mode: {"first": []} for mode in sandboxes}
    try:
        for mode, sandbox in sandboxes.items():
            figures[mode]["first"].append(timed_ms(lambda: sandbox.execute("bash", {"command": "true"}))[0])
        for i in range(rounds):
            modes = list(sandboxes) if i % 2 == 0 else list(reversed(sandboxes))
            for command in CALL_COMMANDS:
                for observed in (False, True):
                    for mode in modes:
                        run = sandboxes[mode].execute_observed if observed else sandboxes[mode].execute
                        ms, result = timed_ms(lambda: run("bash", {"command": command}))
                        result = result[0] if observed else result
                        if result["exit_code"] != 0 or result["stdout"] or result["stderr"]:
                            raise RuntimeError(f"{mode}: {command!r} answered {result}")
                        figures[mode].setdefault(f"{command} ({'observed' if observed else 'plain'})", []).append(ms)
    finally:
        for sandbox in sandboxes.values():
            sandbox.stop()
    return {
        "image": image,
        "rounds": rounds,
        **{mode: {kind: summary(values) for kind, values in kinds.items()} for mode, kinds in figures.items()},
    }


def cold_forks(backend, image: str, labels: dict[str, str], rounds: int) -> dict[str, Any]:
    """Snapshot -> running container -> first exec done. Each round takes a new snapshot, so the
    first fork is the first container ever made from its image; the second fork shows reuse."""
    env = {"backend": "docker", "image": image}
    source = backend.start(env, labels=labels)
    first_fork, first_exec, first_total, second_total, commits = [], [], [], [], []
    try:
        for i in range(rounds):
            source.execute("bash", {"command": f"mkdir -p /w && cd /w && export ROUND={i} && echo {i} > r{i}"})
            info = source.snapshot(labels=labels)
            commits.append(info.create_ms)
            for attempt in range(2):
                fork_ms, fork = timed_ms(lambda: backend.fork(info.ref, env, labels=labels))
                exec_ms, result = timed_ms(
                    lambda: fork.execute("bash", {"command": f'test "$PWD/$ROUND" = /w/{i} && cat r{i}'})
                )
                fork.stop()
                if result["exit_code"] != 0:
                    raise RuntimeError(f"a fork lost its session state: {result}")
                if attempt == 0:
                    first_fork.append(fork_ms)
                    first_exec.append(exec_ms)
                    first_total.append(fork_ms + exec_ms)
                else:
                    second_total.append(fork_ms + exec_ms)
            backend.delete_snapshot(info.ref)
    finally:
        source.stop()
    return {
        "image": image,
        "snapshot_commit": summary(commits),
        "fork": summary(first_fork),
        "first_exec": summary(first_exec),
        "fork_and_first_exec": summary(first_total),
        "second_fork_and_first_exec": summary(second_total),
    }


def snapshot_sizes(
    backend, image: str, labels: dict[str, str], sizes_mb: list[int], rounds: int
) -> list[dict[str, Any]]:
    """Commit time and snapshot size of a sandbox that wrote N MB, and a fork of it."""
    env = {"backend": "docker", "image": image}
    rows = []
    for size_mb in sizes_mb:
        commits, sizes, forks = [], [], []
        for _ in range(rounds):
            sandbox = backend.start(env, labels=labels)
            try:
                if size_mb:
                    sandbox.execute("bash", {"command": f"head -c {size_mb * 1024 * 1024} /dev/urandom > /data.bin"})
                info = sandbox.snapshot(labels=labels)
                commits.append(info.create_ms)
                sizes.append(info.size_bytes)
                fork_ms, fork = timed_ms(lambda: backend.fork(info.ref, env, labels=labels))
                exec_ms, _ = timed_ms(lambda: fork.execute("bash", {"command": "true"}))
                forks.append(fork_ms + exec_ms)
                fork.stop()
                backend.delete_snapshot(info.ref)
            finally:
                sandbox.stop()
        rows.append(
            {
                "written_mb": size_mb,
                "commit": summary(commits),
                "size_mb": round(sorted(sizes)[len(sizes) // 2] / 1e6, 1),
                "fork_and_first_exec": summary(forks),
            }
        )
    return rows


def start_rates(
    make_backend: Callable[[int], Any],
    image: str,
    labels: dict[str, str],
    concurrencies: list[int],
    count: int,
    threads: int = 8,
) -> list[dict[str, Any]]:
    """`count` starts (container created, running, shell session initialised) requested by
    `threads` callers at once, with the start limiter set to each concurrency."""
    env = {"backend": "docker", "image": image}
    rows = []
    for concurrency in concurrencies:
        backend = make_backend(concurrency)
        latencies: list[float] = []
        lock = threading.Lock()

        def start_one(_: int):
            ms, sandbox = timed_ms(lambda: backend.start(env, labels=labels))
            with lock:
                latencies.append(ms)
            return sandbox

        with ThreadPoolExecutor(max_workers=threads) as pool:
            wall_ms, sandboxes = timed_ms(lambda: list(pool.map(start_one, range(count))))
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(lambda s: s.stop(), sandboxes))
        rows.append(
            {
                "max_concurrent_starts": concurrency,
                "starts": count,
                "callers": threads,
                "starts_per_s": round(count / (wall_ms / 1000), 2),
                "start": summary(latencies),
            }
        )
    return rows


def remove_labelled(backend, selector: dict[str, str]) -> dict[str, int]:
    sandboxes = backend.list_sandboxes(selector)
    for resource in sandboxes:
        backend.remove_sandbox(resource.id)
    snapshots = backend.list_snapshots(selector)
    for resource in snapshots:
        backend.delete_snapshot(resource.id)
    return {"sandboxes": len(sandboxes), "snapshots": len(snapshots)}


# --- rollouts: seeded stochastic policies ------------------------------------------------------


@dataclass(frozen=True)
class Action:
    weight: float
    command: str | None  # None: retry the previous command


@dataclass(frozen=True)
class TaskPolicy:
    """A terminal task: a shared setup prefix, then branches drawn from weighted actions. Later
    epochs sharpen the weights (the policy learns), so rollouts repeat each other more."""

    name: str
    image: str
    setup: tuple[str, ...]
    actions: tuple[Action, ...]
    steps: int

    def plan(self, rng: random.Random, epoch: int) -> list[tuple[float, str]]:
        """(think time before the call in s, command) for one rollout."""
        sharpness = 1.0 + 0.75 * epoch
        weights = [a.weight**sharpness for a in self.actions]
        commands = list(self.setup)
        for _ in range(self.steps):
            action = rng.choices(self.actions, weights)[0]
            commands.append(action.command if action.command is not None else commands[-1])
        # The model generates between tool calls; rollouts of a group drift apart in time.
        return [(rng.uniform(0.05, 0.4), command) for command in commands]


def _edits(template: str, keys: list[str], values: list[int]) -> list[Action]:
    return [
        Action(4.0 / (1 + i + j), template.format(key=key, value=value))
        for i, key in enumerate(keys)
        for j, value in enumerate(values)
    ]


POLICIES = {
    # Shell configuration fixing in busybox: edit a config, inspect, run a slow check.
    "busybox": TaskPolicy(
        name="busybox",
        image="tvcache/busybox:latest",
        setup=(
            "sleep 1; mkdir -p /app && cd /app && printf 'A=1\\nB=2\\nC=3\\n' > config"
            " && printf '. ./config\\necho $((A + B * C))\\n' > run.sh",
            "sh run.sh",
        ),
        actions=(
            *_edits("sed -i 's/^{key}=.*/{key}={value}/' config", ["A", "B", "C"], [1, 2, 3]),
            Action(3.0, "cat config"),
            Action(4.0, "sh run.sh"),
            Action(1.0, "ls"),
            Action(1.0, "grep -c = config"),
            Action(3.0, 'sleep 0.5; test "$(sh run.sh)" = 7 && echo PASS || echo FAIL'),
            Action(1.5, None),
        ),
        steps=7,
    ),
    # A C program in Debian: write it, build it with gcc, then edit / rebuild / run / inspect.
    "gcc": TaskPolicy(
        name="gcc",
        image="tvcache/debian:bookworm",
        setup=(
            "sleep 1; mkdir -p /src && cd /src && printf '#include <stdio.h>\\nint f(int x) { return x * 2; }\\n"
            'int main(void) { printf("%%d\\\\n", f(21)); return 0; }\\n\' > main.c',
            "gcc -O1 -o prog main.c && ./prog",
        ),
        actions=(
            *_edits("sed -i 's/x \\* [0-9]*/x * {value}/' main.c", ["k"], [2, 3, 4]),
            *_edits("sed -i 's/f([0-9]*)/f({value})/' main.c", ["n"], [21, 1, 42]),
            Action(5.0, "gcc -O1 -o prog main.c && ./prog"),
            Action(3.0, "./prog"),
            Action(1.0, "grep -n return main.c"),
            Action(1.0, "cat main.c"),
            Action(1.5, None),
        ),
        steps=6,
    ),
}


@dataclass(frozen=True)
class RolloutPlan:
    task_id: str
    policy: str
    rollout_id: str
    calls: list[tuple[float, str]]


def epoch_plans(task_ids: dict[str, str], rollouts: int, epoch: int, seed: int) -> list[RolloutPlan]:
    plans = []
    for policy_name, task_id in task_ids.items():
        for index in range(rollouts):
            rng = random.Random(f"{seed}/{policy_name}/{epoch}/{index}")
            plans.append(
                RolloutPlan(task_id, policy_name, f"e{epoch}-r{index}", POLICIES[policy_name].plan(rng, epoch))
            )
    return plans


@dataclass
class RolloutRun:
    plan: RolloutPlan
    latencies_ms: list[float] = field(default_factory=list)
    cached: list[bool] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_ms: float = 0.0
    start_ms: float | None = None  # without cache: the fresh sandbox's start


def run_with_cache(client: httpx.Client, plan: RolloutPlan, epoch: int) -> RolloutRun:
    """One rollout in tool-server mode over HTTP; the rollout is ended (DELETE) when done."""
    run = RolloutRun(plan)
    started = time.perf_counter()
    url = f"/api/v1/tasks/{plan.task_id}/rollouts/{plan.rollout_id}"
    for think_s, command in plan.calls:
        time.sleep(think_s)
        ms, response = timed_ms(lambda: client.post(f"{url}/calls", json={"call": bash(command), "epoch": epoch}))
        if response.status_code != 200:
            run.errors.append(f"{response.status_code}: {response.text[:300]}")
            break
        run.latencies_ms.append(ms)
        run.cached.append(bool(response.json()["cached"]))
    run.wall_ms = (time.perf_counter() - started) * 1000
    client.delete(url)
    return run


def run_without_cache(backend, plan: RolloutPlan, labels: dict[str, str]) -> RolloutRun:
    """The same rollout executed directly in a fresh sandbox of its own (no service)."""
    run = RolloutRun(plan)
    started = time.perf_counter()
    run.start_ms, sandbox = timed_ms(
        lambda: backend.start({"backend": "docker", "image": POLICIES[plan.policy].image}, labels=labels)
    )
    try:
        for think_s, command in plan.calls:
            time.sleep(think_s)
            ms, _ = timed_ms(lambda: sandbox.execute("bash", {"command": command}))
            run.latencies_ms.append(ms)
            run.cached.append(False)
    finally:
        sandbox.stop()
    run.wall_ms = (time.perf_counter() - started) * 1000
    return run


def run_parallel(
    runner: Callable[[RolloutPlan], RolloutRun], plans: list[RolloutPlan]
) -> tuple[float, list[RolloutRun]]:
    with ThreadPoolExecutor(max_workers=len(plans)) as pool:
        return timed_ms(lambda: list(pool.map(runner, plans)))


def epoch_figures(runs: list[RolloutRun]) -> dict[str, Any]:
    latencies = [ms for run in runs for ms in run.latencies_ms]
    hits = [ms for run in runs for ms, cached in zip(run.latencies_ms, run.cached) if cached]
    misses = [ms for run in runs for ms, cached in zip(run.latencies_ms, run.cached) if not cached]
    calls = len(latencies)
    return {
        "calls": calls,
        "hit_rate": round(len(hits) / calls, 3) if calls else None,
        "call": summary(latencies),
        "hit": summary(hits),
        "miss": summary(misses),
        "step_s": round(max(run.wall_ms for run in runs) / 1000, 2),
        "errors": [e for run in runs for e in run.errors][:5],
        "error_count": sum(len(run.errors) for run in runs),
        "sandbox_start": summary([run.start_ms for run in runs if run.start_ms is not None]),
    }


def wait_for(predicate: Callable[[], bool], timeout_s: float) -> float | None:
    """Seconds until `predicate` held, or None on timeout."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.05)
    return None
