"""`python manage.py bench_sandboxes [--image TAG] [--rounds N] [--out FILE]`: docker backend figures.

Measures what the snapshot policy and the fork pools are tuned with: the commit time of a
snapshot, cold and warm fork latency (snapshot image -> running container -> first call done),
one call's latency, and container starts per second at limiter concurrency 2 and 4. Figures go
to a JSON file (default VAR_DIR/bench/sandboxes.json); everything it creates is removed.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from sandboxes.backends.config import DockerConfig
from sandboxes.backends.docker import DockerBackend
from sandboxes.images import BUSYBOX_TAG

BENCH_LABEL = "tvcache.bench"


def _timed_ms(action: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = action()
    return (time.perf_counter() - started) * 1000, value


def _summary(samples_ms: list[float]) -> dict[str, float]:
    ordered = sorted(samples_ms)
    return {
        "median_ms": round(statistics.median(ordered), 1),
        "p95_ms": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 1),
        "n": len(ordered),
    }


class Command(BaseCommand):
    help = "Measure docker sandbox snapshot, fork and start costs on this engine."
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--image", default=BUSYBOX_TAG)
        parser.add_argument("--rounds", type=int, default=10)
        parser.add_argument("--out", type=Path, default=None)

    def handle(self, *args: object, image: str, rounds: int, out: Path | None, **options: object) -> None:
        env = {"backend": "docker", "image": image}
        labels = {BENCH_LABEL: uuid.uuid4().hex}
        backend = DockerBackend(DockerConfig())
        try:
            figures = {"image": image, **self._forks(backend, env, labels, rounds), "starts": self._starts(env, labels, rounds)}
        finally:
            self._clean(backend, labels)
        out = out or Path(settings.VAR_DIR) / "bench" / "sandboxes.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figures, indent=2))
        self.stdout.write(json.dumps(figures, indent=2))

    def _forks(self, backend: DockerBackend, env: dict[str, Any], labels: dict[str, str], rounds: int) -> dict[str, Any]:
        sandbox = backend.start(env, labels=labels)
        calls, commits, snapshots, cold, warm = [], [], [], [], []
        for i in range(rounds):
            calls.append(_timed_ms(lambda: sandbox.execute("bash", {"command": "true"}))[0])
            sandbox.execute("bash", {"command": f"cd /tmp && export ROUND={i} && head -c 1048576 /dev/urandom > r{i}"})
            snapshot_ms, info = _timed_ms(sandbox.snapshot)
            snapshots.append(snapshot_ms)
            commits.append(info.create_ms)
            # Cold: the first container ever made from this snapshot image; warm: the second.
            for samples in (cold, warm):
                fork_ms, fork = _timed_ms(lambda: self._fork_and_call(backend, info.ref, env, labels))
                samples.append(fork_ms)
                fork.stop()
        return {
            "call_true": _summary(calls),
            "snapshot_commit": _summary(commits),
            "snapshot_total": _summary(snapshots),
            "fork_cold_first_call": _summary(cold),
            "fork_warm_first_call": _summary(warm),
        }

    @staticmethod
    def _fork_and_call(backend: DockerBackend, ref: str, env: dict[str, Any], labels: dict[str, str]) -> Any:
        fork = backend.fork(ref, env, labels=labels)
        result = fork.execute("bash", {"command": 'test "$PWD" = /tmp'})
        if result["exit_code"] != 0:
            raise RuntimeError(f"fork lost its session state: {result}")
        return fork

    def _starts(self, env: dict[str, Any], labels: dict[str, str], rounds: int) -> dict[str, Any]:
        figures = {}
        count = max(rounds, 8)
        for concurrency in (1, 2, 4):
            backend = DockerBackend(DockerConfig(max_concurrent_starts=concurrency))
            with ThreadPoolExecutor(max_workers=8) as pool:
                wall_ms, sandboxes = _timed_ms(lambda: list(pool.map(lambda _: backend.start(env, labels=labels), range(count))))
            figures[f"concurrency_{concurrency}"] = {"starts": count, "starts_per_s": round(count / (wall_ms / 1000), 2)}
            for sandbox in sandboxes:
                sandbox.stop()
        return figures

    @staticmethod
    def _clean(backend: DockerBackend, labels: dict[str, str]) -> None:
        for sandbox in backend.list_sandboxes(labels):
            backend.remove_sandbox(sandbox.id)
        for snapshot in backend.list_snapshots(labels):
            backend.delete_snapshot(snapshot.id)
