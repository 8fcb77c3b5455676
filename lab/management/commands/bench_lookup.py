"""Lookup latency under fixed offered rates (open loop, load from a separate process).

Loads a task of 8,192 nodes with histories 1 to 32 calls deep, serves it as deployed (uvicorn,
the ASGI application, 3 worker processes), and drives hit and miss lookups at each rate, several
runs per rate: on a shared 2-core machine one run's tail swings by 2x from run to run. Writes
artifacts/bench/lookup.json (every run) and lookup.md (the median run of each rate).
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand

from accounts.models import ApiToken
from accounts.services.tokens import token_create
from cache.services import node_record, task_flush, task_put
from cache.tcg import ToolCall
from cache.tcg.records import CallContext, CallRecord
from lab.figures import percentile
from lab.server import service_running

TASK = "bench-lookup"


def build_graph(nodes: int, max_depth: int, seed: int) -> list[tuple[list[ToolCall], ToolCall]]:
    """Record rollouts that share prefixes and branch, until the task holds `nodes` nodes."""
    rng = random.Random(seed)
    task_put(
        task_id=TASK,
        env={"backend": "external", "bench": "lookup"},
        tools={"cat": {"mutates_state": False, "cacheable": True}},
        sandbox_budget=0,
    )
    task_flush(task_id=TASK)
    seen: set[tuple] = set()
    paths: list[tuple[list[ToolCall], ToolCall]] = []
    while len(paths) < nodes:
        history: list[ToolCall] = []
        for depth in range(rng.randint(1, max_depth)):
            if rng.random() < 0.3:
                call = ToolCall("cat", {"path": f"file{rng.randint(0, 3)}"})
            else:
                call = ToolCall("bash", {"command": f"step {depth} variant {rng.randint(0, 2)}"})
            key = (tuple((c.tool, str(c.args)) for c in history), call.tool, str(call.args))
            if key not in seen and len(paths) < nodes:
                seen.add(key)
                context = CallContext(tuple(history), call, "bench", 0, None)
                node_record(task_id=TASK, record=CallRecord(context, {"stdout": "x" * 200, "exit_code": 0}, 100.0))
                paths.append((list(history), call))
            history.append(call)
    return paths


def lookup_requests(paths, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed + 1)
    requests = []
    for index in range(count):
        history, call = rng.choice(paths)
        if index % 2:  # a miss: the same history, a call never recorded
            call, kind = ToolCall("bash", {"command": f"new {index}"}), "miss"
        else:
            kind = "hit"
        body = {"history": [c.to_json() for c in history], "call": call.to_json(), "rollout_id": f"b{index % 64}"}
        requests.append({"kind": kind, "path": f"/api/v1/tasks/{TASK}/lookup", "body": body})
    return requests


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser):
        parser.add_argument("--rates", default="256,512,1024,2048")
        parser.add_argument("--duration", type=float, default=10.0)
        parser.add_argument("--workers", type=int, default=3)
        parser.add_argument(
            "--repeat",
            type=int,
            default=3,
            help="runs per rate; the table shows the run with the median hit P95, the JSON all of them",
        )
        parser.add_argument("--loadgen-processes", type=int, default=1)
        parser.add_argument("--nodes", type=int, default=8192)
        parser.add_argument("--seed", type=int, default=7)
        parser.add_argument("--out", default=str(Path(settings.BASE_DIR) / "artifacts" / "bench"))

    def handle(self, *args, rates, duration, workers, repeat, loadgen_processes, nodes, seed, out, **options):
        self.stdout.write(f"loading {nodes} nodes ...")
        paths = build_graph(nodes, 32, seed)
        ApiToken.objects.filter(name="bench-lookup").delete()
        token = token_create(name="bench-lookup")
        rows = []
        self.loadgen_processes = loadgen_processes
        with tempfile.TemporaryDirectory() as tmp, service_running(workers=workers) as running:
            bodies = Path(tmp) / "requests.json"
            bodies.write_text(json.dumps(lookup_requests(paths, 4096, seed)))
            self._drive(running, bodies, token, 256, 3.0, Path(tmp) / "warmup.json")  # warm connections and caches
            for rate in [float(r) for r in rates.split(",")]:
                runs = [
                    self._summarize(
                        rate, self._drive(running, bodies, token, rate, duration, Path(tmp) / f"{rate}.json")
                    )
                    for _ in range(repeat)
                ]
                median = sorted(runs, key=lambda r: r["hit"]["p95"])[len(runs) // 2]
                rows.append({**median, "runs": runs})
                self.stdout.write(json.dumps(median))
        self._write(
            Path(out),
            rows,
            workers=workers,
            nodes=nodes,
            duration=duration,
            repeat=repeat,
            loadgen_processes=loadgen_processes,
            cores=os.cpu_count(),
        )

    def _drive(self, running, bodies, token, rate, duration, out) -> dict:
        """One open-loop run; also what it cost: the load generator's and the server's CPU seconds
        (they share the machine with PostgreSQL) and the machine's load before it started."""
        load_before = os.getloadavg()[0]
        server_before, loadgen_before = running.cpu_s(), _children_cpu_s()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "lab.bench.loadgen",
                "--url",
                running.url,
                "--rate",
                str(rate),
                "--duration",
                str(duration),
                "--requests",
                str(bodies),
                "--token",
                token,
                "--processes",
                str(self.loadgen_processes),
                "--out",
                str(out),
            ],
            check=True,
        )
        result = json.loads(out.read_text())
        result["cpu_s"] = {"server": running.cpu_s() - server_before, "loadgen": _children_cpu_s() - loadgen_before}
        result["load_avg_before"] = load_before
        return result

    @staticmethod
    def _summarize(rate: float, result: dict) -> dict:
        done = len(result["results"])
        row = {
            "offered_rps": rate,
            "achieved_rps": round(done / result["elapsed_s"], 1),
            "errors": sum(1 for _, status, _ in result["results"] if status != 200),
            "cpu_ms_per_request": {
                name: round(1000 * seconds / max(done, 1), 3) for name, seconds in result["cpu_s"].items()
            },
            "load_avg_before": round(result["load_avg_before"], 2),
        }
        for kind in ("hit", "miss"):
            latencies = [ms for k, status, ms in result["results"] if k == kind]
            row[kind] = {f"p{q}": percentile(latencies, q, 2) for q in (50, 95, 99)}
        return row

    def _write(self, out: Path, rows: list[dict], **meta) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "lookup.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        lines = [
            "| offered req/s | achieved req/s | hit P50 / P95 / P99 ms | miss P50 / P95 / P99 ms | errors "
            "| CPU ms/req server / loadgen | load avg before |",
            "|---:|---:|---|---|---:|---|---:|",
        ]
        for r in rows:
            hit, miss, cpu = r["hit"], r["miss"], r["cpu_ms_per_request"]
            lines.append(
                f"| {r['offered_rps']:.0f} | {r['achieved_rps']:.0f} | {hit['p50']} / {hit['p95']} / {hit['p99']} "
                f"| {miss['p50']} / {miss['p95']} / {miss['p99']} | {r['errors']} "
                f"| {cpu['server']} / {cpu['loadgen']} | {r['load_avg_before']} |"
            )
        (out / "lookup.md").write_text("\n".join(lines) + "\n")
        self.stdout.write("\n".join(lines))


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
