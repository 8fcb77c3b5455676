"""Hits' latency under overload: slow tool-server leaders with waiters, plus a flood of
unauthenticated 2 MB bodies (docs/lab/benchmarks.md).

Serves tvcache as deployed (lab/server.py: uvicorn, production settings), sets it up over
HTTP (a client-mode task of recorded paths, a docker task with a recorded read-only call), then
runs two phases of --duration seconds with the same open-loop offered rate of hits
(lab/bench/loadgen.py): lookups that hit and tool-server calls that hit, half and half.

- quiet: the hits alone;
- stressed: the hits, while --leaders tool-server rollouts each run a different slow call
  (`sleep`, longer than the phase) with --waiters rollouts each waiting for that same call
  (single flight), and --flood connections send POSTs with 2 MB bodies back to back, half
  without a token and half with a bad one.

Writes overload.json (every figure) and overload.md (the table) under --out. Loopback only,
bounded in time (the phases, a drain, the leaders' run).

    python -m lab.bench.overload --out artifacts/bench
    python -m lab.bench.overload --served-from /path/to/another/checkout   # e.g. before a change

Needs DATABASE_URL (the served instance's database, migrated), SECRET_KEY or DEBUG for the
token command, and a Docker engine with the busybox base image (manage.py build_images).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from lab.figures import percentile
from lab.server import ROOT, service_running

FLOOD_BODY_BYTES = 2 * 1024 * 1024


def token_made(root: Path) -> str:
    name = f"overload-{uuid.uuid4().hex[:8]}"
    done = subprocess.run(
        [sys.executable, "manage.py", "create_token", name], cwd=root, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def bash(command: str) -> dict:
    return {"tool": "bash", "args": {"command": command}}


def setup(client: httpx.Client, run_id: str, paths: int) -> tuple[str, str, list[dict]]:
    """A client-mode task with `paths` recorded calls and a docker task with a recorded read-only
    call; the hit requests for the load generator."""
    lookup_task, tool_task = f"ovl-{run_id}", f"ovl-docker-{run_id}"
    put = client.put(
        f"/api/v1/tasks/{lookup_task}",
        json={"env": {"backend": "external", "run": run_id}, "tools": {}, "sandbox_budget": 0},
    )
    put.raise_for_status()
    history: list[dict] = []
    recorded = []
    for index in range(paths):
        call = bash(f"step {index % 16} of {index // 16}")
        prefix = history[: index % 8]
        client.post(
            f"/api/v1/tasks/{lookup_task}/record",
            json={"history": prefix, "call": call, "result": {"stdout": "x" * 200}, "exec_ms": 100.0},
        ).raise_for_status()
        recorded.append((list(prefix), call))
        if len(history) < 8:
            history.append(call)
    put = client.put(f"/api/v1/tasks/{tool_task}", json={"env": {"backend": "docker"}, "sandbox_budget": 64})
    put.raise_for_status()
    first = client.post(f"/api/v1/tasks/{tool_task}/rollouts/setup/calls", json={"call": bash("echo cached")})
    first.raise_for_status()
    assert first.json()["mutates"] is False, first.text  # a hit on it leaves the rollout's history as it was
    client.delete(f"/api/v1/tasks/{tool_task}/rollouts/setup")
    requests = []
    for index in range(4096):
        if index % 2:
            # 256 rollouts in turn, as a step's rollouts call again and again (a rollout's first
            # call creates it); the same one comes back 5 s later at 100 requests/s.
            requests.append(
                {
                    "kind": "tool_hit",
                    "path": f"/api/v1/tasks/{tool_task}/rollouts/h{index // 2 % 256}/calls",
                    "body": {"call": bash("echo cached")},
                }
            )
        else:
            prefix, call = recorded[index // 2 % len(recorded)]
            requests.append(
                {
                    "kind": "lookup_hit",
                    "path": f"/api/v1/tasks/{lookup_task}/lookup",
                    "body": {"history": prefix, "call": call},
                }
            )
    return lookup_task, tool_task, requests


def drive(url: str, token: str, requests_file: Path, rate: float, duration: float, out: Path) -> dict:
    """One open-loop run of the load generator."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "lab.bench.loadgen",
            "--url",
            url,
            "--rate",
            str(rate),
            "--duration",
            str(duration),
            "--requests",
            str(requests_file),
            "--token",
            token,
            "--connections",
            "32",
            "--drain",
            "60",
            "--out",
            str(out),
        ],
        check=True,
        cwd=ROOT,
    )
    return json.loads(out.read_text())


def summary(result: dict, service, cpu_before: float, load_before: float) -> dict:
    """Latency percentiles and answers per kind of hit; the server's CPU seconds meanwhile and the
    machine's 1-minute load average before the phase (the machine is shared)."""
    rows: dict = {"server_cpu_s": round(service.cpu_s() - cpu_before, 1), "load_avg_before": round(load_before, 2)}
    for kind in ("lookup_hit", "tool_hit"):
        latencies = [ms for k, _, ms in result["results"] if k == kind]
        statuses: dict[str, int] = {}
        for k, status, _ in result["results"]:
            if k == kind:
                statuses[str(status)] = statuses.get(str(status), 0) + 1
        rows[kind] = {
            "requests": len(latencies),
            "statuses": statuses,
            **{f"p{q}": percentile(latencies, q, 2) for q in (50, 95, 99)},
            "max": percentile(latencies, 100, 2),
        }
    return rows


async def _flood(host: str, port: int, connections: int, until: float, tally: dict) -> None:
    head = {
        False: (
            f"POST /api/v1/tasks/any/lookup HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {FLOOD_BODY_BYTES}\r\n\r\n"
        ).encode(),
        True: (
            f"POST /api/v1/tasks/any/lookup HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Token bad"
            f"\r\nContent-Type: application/json\r\nContent-Length: {FLOOD_BODY_BYTES}\r\n\r\n"
        ).encode(),
    }
    body = b" " * FLOOD_BODY_BYTES

    async def one(with_token: bool) -> None:
        while time.monotonic() < until:
            try:
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(head[with_token] + body)
                line = await asyncio.wait_for(reader.readline(), 30)
                status = line.split(b" ")[1].decode() if line.startswith(b"HTTP/") else "none"
                tally[status] = tally.get(status, 0) + 1
                writer.close()
            except (TimeoutError, OSError) as exc:
                tally[type(exc).__name__] = tally.get(type(exc).__name__, 0) + 1

    await asyncio.gather(*(one(bool(i % 2)) for i in range(connections)))


def flood(host: str, port: int, connections: int, seconds: float, queue) -> None:
    """Run as a process of its own: unauthenticated 2 MB bodies, back to back on each connection."""
    tally: dict = {}
    started = time.monotonic()
    asyncio.run(_flood(host, port, connections, started + seconds, tally))
    tally["requests_per_s"] = round(sum(v for k, v in tally.items() if k.isdigit()) / (time.monotonic() - started), 1)
    queue.put(tally)


def leaders_and_waiters(
    client: httpx.Client, task: str, leaders: int, waiters: int, slow_s: float, pool: ThreadPoolExecutor
) -> list:
    """Start the slow leaders, wait until each runs in its sandbox, then their waiters."""

    def call(rollout: str, command: str) -> dict:
        started = time.perf_counter()
        response = client.post(
            f"/api/v1/tasks/{task}/rollouts/{rollout}/calls", json={"call": bash(command)}, timeout=slow_s + 120
        )
        body = response.json()
        return {
            "rollout": rollout,
            "status": response.status_code,
            "cached": body.get("cached"),
            "seconds": round(time.perf_counter() - started, 2),
            "node_id": body.get("node_id"),
        }

    commands = [f"sleep {slow_s:.0f}; echo slow {i}" for i in range(leaders)]
    futures = [pool.submit(call, f"lead{i}", command) for i, command in enumerate(commands)]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pools = client.get("/api/v1/pools").json()["pools"]
        leased = sum(p["states"]["leased"] for p in pools if p["task_id"] == task)
        if leased >= leaders:
            break
        time.sleep(0.2)
    futures += [
        pool.submit(call, f"wait{i}-{j}", command) for i, command in enumerate(commands) for j in range(waiters)
    ]
    time.sleep(1.0)  # they wait by now
    return futures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=100.0, help="hits per second offered (both kinds)")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--leaders", type=int, default=12)
    parser.add_argument("--waiters", type=int, default=3, help="per leader")
    parser.add_argument("--flood", type=int, default=8, help="connections sending 2 MB bodies")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--paths", type=int, default=256)
    parser.add_argument("--served-from", type=Path, default=ROOT, help="the checkout whose service is measured")
    parser.add_argument("--out", type=Path, default=ROOT / "artifacts" / "bench")
    args = parser.parse_args()
    os.environ.setdefault("DB_POOL_SIZE", "24")  # 12 tool runs hold a connection each, plus the other lanes
    token = token_made(args.served_from)
    run_id = uuid.uuid4().hex[:6]
    figures: dict = {
        "meta": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "cores": os.cpu_count(),
            "flood_body_bytes": FLOOD_BODY_BYTES,
        }
    }
    with (
        tempfile.TemporaryDirectory() as tmp,
        service_running(workers=args.workers, root=args.served_from) as service,
        httpx.Client(base_url=service.url, headers={"Authorization": f"Token {token}"}, timeout=120) as client,
    ):
        _, tool_task, requests = setup(client, run_id, args.paths)
        requests_file = Path(tmp) / "requests.json"
        requests_file.write_text(json.dumps(requests))
        drive(service.url, token, requests_file, args.rate, 3.0, Path(tmp) / "warmup.json")
        before = service.cpu_s(), os.getloadavg()[0]
        figures["quiet"] = summary(
            drive(service.url, token, requests_file, args.rate, args.duration, Path(tmp) / "quiet.json"),
            service,
            *before,
        )
        print("quiet", json.dumps(figures["quiet"]), flush=True)
        slow_s = args.duration + 15
        with ThreadPoolExecutor(args.leaders * (1 + args.waiters)) as pool:
            calls = leaders_and_waiters(client, tool_task, args.leaders, args.waiters, slow_s, pool)
            queue = multiprocessing.get_context("fork").Queue()
            host, port = service.url.removeprefix("http://").split(":")
            flooder = multiprocessing.get_context("fork").Process(
                target=flood, args=(host, int(port), args.flood, args.duration + 1, queue)
            )
            before = service.cpu_s(), os.getloadavg()[0]
            flooder.start()
            stressed = drive(service.url, token, requests_file, args.rate, args.duration, Path(tmp) / "stressed.json")
            figures["flood"] = queue.get(timeout=120)
            flooder.join()
            figures["stressed"] = summary(stressed, service, *before)
            print("stressed", json.dumps(figures["stressed"]), flush=True)
            outcomes = [future.result() for future in calls]
        leaders = [o for o in outcomes if o["rollout"].startswith("lead")]
        waiters = [o for o in outcomes if o["rollout"].startswith("wait")]
        figures["leaders"] = {
            "answered": sum(o["status"] == 200 for o in leaders),
            "of": len(leaders),
            "seconds_max": max(o["seconds"] for o in leaders),
        }
        figures["waiters"] = {
            "answered_cached": sum(o["status"] == 200 and bool(o["cached"]) for o in waiters),
            "of": len(waiters),
            "statuses": sorted({o["status"] for o in waiters}),
        }
        figures["executions"] = client.get(f"/api/v1/tasks/{tool_task}/stats").json()["executions"]
        for outcome in outcomes:  # their sandboxes are stopped (waiters that got a hit have none)
            client.delete(f"/api/v1/tasks/{tool_task}/rollouts/{outcome['rollout']}")
    write(args.out, figures)


def write(out: Path, figures: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "overload.json").write_text(json.dumps(figures, indent=2))
    meta = figures["meta"]
    lines = [
        f"{meta['rate']:.0f} hits/s offered (lookups and tool-server calls, half and half), {meta['duration']:.0f} s "
        f"per phase, {meta['workers']} uvicorn workers, {meta['cores']} cores shared with the load.",
        f"Stressed: {meta['leaders']} slow tool-server leaders with {meta['waiters']} waiters each, and "
        f"{meta['flood']} connections sending 2 MB bodies without a valid token "
        f"({figures['flood'].get('requests_per_s')} requests/s: {_tally(figures['flood'])}).",
        "",
        "| phase | hit | P50 ms | P95 ms | P99 ms | max ms | answers | server CPU s | load avg before |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for phase in ("quiet", "stressed"):
        for kind in ("lookup_hit", "tool_hit"):
            row = figures[phase][kind]
            lines.append(
                f"| {phase} | {kind} | {row['p50']} | {row['p95']} | {row['p99']} | {row['max']} "
                f"| {_tally(row['statuses'])} | {figures[phase]['server_cpu_s']} "
                f"| {figures[phase]['load_avg_before']} |"
            )
    lines += [
        "",
        f"Leaders answered: {figures['leaders']['answered']} of {figures['leaders']['of']}; waiters answered "
        f"from the leader's result: {figures['waiters']['answered_cached']} of {figures['waiters']['of']}; "
        f"tool runs of the docker task: {figures['executions']}.",
    ]
    (out / "overload.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _tally(counts: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()) if k != "requests_per_s")


if __name__ == "__main__":
    main()
