"""Saturated hit lookups on the side-by-side workload, `wrk -t1 -c8` (docs/lab/benchmarks.md).

The workload is the one run against the TVCache reference server: one task of 256 branches x 32
state-changing calls, the first 4 calls shared by every branch (8,192 calls recorded, 7,172
distinct nodes: each depth of a branch has a state key of its own), then 500 hit lookups of a
random branch at a random depth 1 to 32 (seeded), which wrk cycles through on 8 connections
from one thread.

Serves tvcache as deployed (lab/server.py: uvicorn, production settings) with each --workers
count in turn, builds the task once over the REST API (records, as a client would), writes the
500 lookups as a wrk Lua script (in a temporary folder: it holds the token), warms the server
up, then runs wrk --repeat times per worker count. Before and after the runs of each worker count
every one of the 500 lookups is sent once more and must answer a hit with the recorded node's
result. Writes hits.json (every run) and hits.md (per worker count, the run with the median
rate) under --out, with the latency percentiles wrk measured, the server's CPU seconds, the
machine's CPU use during each run and its 1-minute load average before it (the machine is
shared: wrk, the server and PostgreSQL use the same cores).

    python -m lab.bench.hits --workers 1,2,3 --duration 20 --repeat 3 --out artifacts/bench
    python -m lab.bench.hits --served-from /path/to/another/checkout   # e.g. before a change

Needs wrk (Debian: apt-get install wrk), DATABASE_URL (the served instance's database, migrated)
and SECRET_KEY or DEBUG for the token command.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from lab.bench.overload import bash, token_made
from lab.figures import percentile
from lab.server import ROOT, service_running

BRANCHES, DEPTH, SHARED = 256, 32, 4
LOOKUPS = 500
CONNECTIONS = 8
FLOOR_APP = "lab.bench.floor:application"
WARMUP_S = 5


def branch_calls(branch: int) -> list[dict]:
    return [
        bash(f"make step {depth}") if depth < SHARED else bash(f"branch {branch} step {depth}")
        for depth in range(DEPTH)
    ]


def result_of(branch: int, depth: int) -> dict:
    """What the call at `depth` (0-based) of `branch` returned: the shared prefix's results do not
    depend on the branch (they were executed in the same states)."""
    label = f"prefix {depth}" if depth < SHARED else f"branch {branch} depth {depth}"
    return {"stdout": f"{label}\n" + "x" * 200, "stderr": "", "exit_code": 0}


def build(client: httpx.Client, task: str) -> None:
    """The task and its 8,192 records, over the REST API, 4 branches at a time."""
    client.put(
        f"/api/v1/tasks/{task}",
        json={"env": {"backend": "external", "bench": "hits", "task": task}, "tools": {}, "sandbox_budget": 0},
    ).raise_for_status()

    def record_branch(branch: int) -> None:
        calls = branch_calls(branch)
        for depth, call in enumerate(calls):
            client.post(
                f"/api/v1/tasks/{task}/record",
                json={
                    "history": calls[:depth],
                    "call": call,
                    "result": result_of(branch, depth),
                    "exec_ms": 100.0,
                    "rollout_id": f"build-{branch}",
                },
            ).raise_for_status()

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(record_branch, range(BRANCHES)))


def lookups(seed: int) -> list[tuple[dict, dict]]:
    """The 500 hit lookups (body, expected result): a random branch at a random depth 1 to 32."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(LOOKUPS):
        branch, depth = rng.randrange(BRANCHES), rng.randint(1, DEPTH)
        calls = branch_calls(branch)
        chosen.append(({"history": calls[: depth - 1], "call": calls[depth - 1]}, result_of(branch, depth - 1)))
    return chosen


def lua_script(path: str, token: str, bodies: list[bytes]) -> str:
    """A wrk script that sends the bodies in turn (each connection takes the next one) and prints
    wrk's own figures as one JSON line at the end."""
    for body in bodies:
        assert b"]==]" not in body
    listed = ",\n".join(f"[==[{body.decode()}]==]" for body in bodies)
    return f"""
local bodies = {{
{listed}
}}
local requests = {{}}
local next_index = 0

function init(args)
  local headers = {{["Content-Type"] = "application/json", ["Authorization"] = "Token {token}"}}
  for i, body in ipairs(bodies) do
    requests[i] = wrk.format("POST", "{path}", headers, body)
  end
end

function request()
  next_index = next_index % #requests + 1
  return requests[next_index]
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {{"requests": %d, "duration_us": %d, "bytes": %d, "errors": {{"connect": %d, "read": %d, ' ..
    '"write": %d, "status": %d, "timeout": %d}}, "latency_ms": {{"mean": %.3f, "stdev": %.3f, "p50": %.3f, ' ..
    '"p90": %.3f, "p99": %.3f, "p99.9": %.3f, "max": %.3f}}}}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency.mean / 1000, latency.stdev / 1000, latency:percentile(50) / 1000, latency:percentile(90) / 1000,
    latency:percentile(99) / 1000, latency:percentile(99.9) / 1000, latency.max / 1000))
end
"""


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wrk(url: str, script: Path, duration: float) -> dict:
    done = subprocess.run(
        ["wrk", "-t1", f"-c{CONNECTIONS}", f"-d{duration:g}s", "--timeout", "10s", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(line for line in done.stdout.splitlines() if line.startswith("WRK_JSON "))
    figures = json.loads(line.removeprefix("WRK_JSON "))
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", done.stdout)
    figures["non_2xx"] = int(non_2xx.group(1)) if non_2xx else 0
    figures["requests_per_s"] = round(figures["requests"] / (figures["duration_us"] / 1e6), 1)
    return figures


def measured(service, url: str, script: Path, duration: float) -> dict:
    """One wrk run, with what the server and the machine spent meanwhile."""
    load_before = os.getloadavg()[0]
    server_before, (busy_before, total_before) = service.cpu_s(), cpu_ticks()
    figures = wrk(url, script, duration)
    busy_after, total_after = cpu_ticks()
    figures["server_cpu_s"] = round(service.cpu_s() - server_before, 2)
    figures["machine_busy"] = round((busy_after - busy_before) / max(1, total_after - total_before), 3)
    figures["load_avg_before"] = round(load_before, 2)
    return figures


def checked(client: httpx.Client, path: str, chosen: list[tuple[dict, dict]]) -> int:
    """Every lookup answers a hit with the recorded result; returns how many were checked."""
    for body, expected in chosen:
        response = client.post(path, json=body)
        response.raise_for_status()
        answer = response.json()
        if answer.get("hit") is not True or answer.get("result") != expected:
            raise AssertionError(f"not the recorded hit: {body} -> {response.text[:300]}")
    return len(chosen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,3", help="uvicorn worker counts, each measured in turn")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per wrk run")
    parser.add_argument("--repeat", type=int, default=3, help="wrk runs per worker count")
    parser.add_argument("--seed", type=int, default=20)
    parser.add_argument("--served-from", type=Path, default=ROOT, help="the checkout whose service is measured")
    parser.add_argument("--label", default="", help="a name for this run in the report (e.g. before, after)")
    parser.add_argument("--out", type=Path, default=ROOT / "artifacts" / "bench")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (Debian: apt-get install wrk)")
    served_from = args.served_from.resolve()
    os.environ["PYTHONPATH"] = str(served_from)  # the served checkout's modules, not this one's
    token = token_made(served_from)
    task = f"hits-{uuid.uuid4().hex[:8]}"
    path = f"/api/v1/tasks/{task}/lookup"
    chosen = lookups(args.seed)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=served_from, capture_output=True, text=True, check=False
    ).stdout.strip()
    figures: dict = {
        "meta": {
            "label": args.label,
            "served_from": str(served_from),
            "commit": commit,
            "workers": args.workers,
            "duration_s": args.duration,
            "repeat": args.repeat,
            "seed": args.seed,
            "connections": CONNECTIONS,
            "wrk_threads": 1,
            "cores": os.cpu_count(),
            "branches": BRANCHES,
            "depth": DEPTH,
            "shared_prefix": SHARED,
            "lookups": LOOKUPS,
            "hit_cache_entries": os.environ.get("TVCACHE_HIT_CACHE_ENTRIES", "default"),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "runs": {},
    }
    built = False
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "hits.lua"
        script.write_text(
            lua_script(path, token, [json.dumps(body, separators=(",", ":")).encode() for body, _ in chosen])
        )
        for workers in [int(w) for w in args.workers.split(",")]:
            with (
                service_running(workers=workers, root=served_from) as service,
                service_running(workers=workers, app=FLOOR_APP, ready_path="/") as floor,
                httpx.Client(base_url=service.url, headers={"Authorization": f"Token {token}"}, timeout=60) as client,
            ):
                if not built:
                    started = time.monotonic()
                    build(client, task)
                    figures["meta"]["build_s"] = round(time.monotonic() - started, 1)
                    built = True
                checks = checked(client, path, chosen)
                wrk(floor.url, script, WARMUP_S)
                wrk(service.url, script, WARMUP_S)
                runs, floors = [], []
                for _ in range(args.repeat):  # in turns: both see the machine as it is at the time
                    floors.append(measured(floor, floor.url, script, args.duration))
                    runs.append(measured(service, service.url, script, args.duration))
                    print(workers, "workers: floor", json.dumps(floors[-1]), flush=True)
                    print(workers, "workers: tvcache", json.dumps(runs[-1]), flush=True)
                checks += checked(client, path, chosen)
            figures["runs"][str(workers)] = {
                **_summary(runs),
                "floor": _summary(floors),
                "hits_checked": checks,
            }
    write(args.out, figures)


def _summary(runs: list[dict]) -> dict:
    """The runs of one arm and worker count, and the run with the median rate."""
    median_rps = percentile([r["requests_per_s"] for r in runs], 50)
    return {
        "median": min(runs, key=lambda r: abs(r["requests_per_s"] - median_rps)),
        "runs": runs,
        "requests_per_s": [r["requests_per_s"] for r in runs],
    }


def write(out: Path, figures: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    name = f"hits-{figures['meta']['label']}" if figures["meta"]["label"] else "hits"
    (out / f"{name}.json").write_text(json.dumps(figures, indent=2))
    meta = figures["meta"]
    lines = [
        (
            f"`wrk -t1 -c{meta['connections']} -d{meta['duration_s']:g}s`, {meta['lookups']} hit lookups cycled "
            f"(task of {meta['branches']} branches x {meta['depth']} calls, shared prefix of {meta['shared_prefix']}), "
            f"{meta['cores']} cores shared with wrk and PostgreSQL; served from {meta['commit']}, hit cache entries: "
            f"{meta['hit_cache_entries']}. The floor: a bare ASGI app under the same uvicorn reading each POST "
            f"and answering a fixed body (lab/bench/floor.py), its runs taking turns with tvcache's. "
            f"Runs per worker count: {meta['repeat']}; each figure is the arm's median run."
        ),
        "",
        (
            "| uvicorn workers | floor req/s | tvcache req/s (runs) | of the floor | tvcache P50 / P90 / P99 ms "
            "| floor P99 ms | errors | server CPU ms/req | load avg before |"
        ),
        "|---:|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    for workers, row in figures["runs"].items():
        m, f = row["median"], row["floor"]["median"]
        errors = m["non_2xx"] + sum(m["errors"].values()) + f["non_2xx"] + sum(f["errors"].values())
        lines.append(
            f"| {workers} | {f['requests_per_s']:.0f} | **{m['requests_per_s']:.0f}** "
            f"({', '.join(f'{r:.0f}' for r in row['requests_per_s'])}) "
            f"| {100 * m['requests_per_s'] / f['requests_per_s']:.0f} % "
            f"| {m['latency_ms']['p50']:.2f} / {m['latency_ms']['p90']:.2f} / {m['latency_ms']['p99']:.2f} "
            f"| {f['latency_ms']['p99']:.2f} | {errors} | {1000 * m['server_cpu_s'] / max(1, m['requests']):.3f} "
            f"| {m['load_avg_before']} |"
        )
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
