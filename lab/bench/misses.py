"""What a miss costs over the call itself, each miss paired with a direct call (docs/lab/benchmarks.md).

Issue 31's first target in a minute instead of a replay: a tool-server miss within 10 ms of a direct
call through the same session agent (median of the paired differences), and a client-mode miss
lookup within 5 ms (P95). Serves tvcache as deployed (lab/server.py: uvicorn, production settings)
on the configured database, with its Celery worker where REDIS_URL is set, and:

- tool-server arm: --rollouts rollouts of one docker task (tvcache/debian:bookworm, no network, the
  session agent), one after another, each --calls state-changing bash calls of its own (each
  appends a line naming the rollout and the step to a file and counts its lines: every call is a
  miss, and the next call depends on it). Beside each rollout, a container of the lab's own (the
  service's docker backend, the session agent: what a trainer without tvcache would run) runs the
  same calls; each miss and its direct call alternate, so both see the machine as it is. The first
  call of a rollout (its sandbox taken from the pool) is reported apart from the rest ("steady":
  the rollout's own sandbox, in the state its last call left).
- client arm: the same calls of --rollouts rollouts of an external task: a miss lookup (with its
  claim), then the record of the direct call's result, each timed at the client.

Every miss's answer must be the bytes its direct call returned (the two containers start from
one image and run the same commands); a difference stops the run. Writes misses.json (every
miss: its time, its direct call's, the service's phases) and misses.md (medians, P95, the
phases' medians) under --out.

    python -m lab.bench.misses --rollouts 6 --calls 30 --out artifacts/bench
    python -m lab.bench.misses --served-from /path/to/another/checkout   # e.g. before a change

Needs a Docker engine with the image built (manage.py build_images), DATABASE_URL (migrated) and
SECRET_KEY or DEBUG for the token command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import django

from lab.bench.overload import bash, token_made
from lab.figures import percentile
from lab.server import ROOT, service_running

IMAGE = "tvcache/debian:bookworm"
ENV = {"backend": "docker", "image": IMAGE, "network": False}


def command(rollout: int, step: int, run: str) -> str:
    """A state-changing call whose answer depends on every call before it in its rollout."""
    return f"echo '{run} rollout {rollout} step {step}' >> /tmp/misses.log && wc -l < /tmp/misses.log"


def tool_server_arm(client, task: str, rollouts: int, calls: int, run: str) -> list[dict]:
    from lab.replay.terminal import DockerEnvironment

    client.put_task(task, ENV, match="history")
    misses = []
    for r in range(rollouts):
        direct = DockerEnvironment(ENV, session=True)
        direct.start()
        try:
            for step in range(calls):
                call = bash(command(r, step, run))
                started = time.perf_counter()
                expected = direct.execute(call)
                direct_ms = (time.perf_counter() - started) * 1000
                started = time.perf_counter()
                answer = client.call(task, f"{run}-r{r}", call)
                miss_ms = (time.perf_counter() - started) * 1000
                if answer.cached:
                    raise SystemExit(f"rollout {r} step {step} was a hit: every call of this workload must miss")
                if answer.result != expected:
                    raise SystemExit(f"rollout {r} step {step}: the miss answered {answer.result!r}, not {expected!r}")
                misses.append(
                    {
                        "rollout": r,
                        "step": step,
                        "miss_ms": round(miss_ms, 3),
                        "direct_ms": round(direct_ms, 3),
                        "phases_ms": dict(answer.phases_ms),
                    }
                )
            client.end_rollout(task, f"{run}-r{r}")
        finally:
            direct.stop()
    return misses


def client_arm(client, task: str, rollouts: int, calls: int, run: str) -> list[dict]:
    client.put_task(task, {"backend": "external", "bench": "misses", "task": task})
    misses = []
    for r in range(rollouts):
        history: list[dict] = []
        for step in range(calls):
            call = bash(command(r, step, run))
            result = {"stdout": f"{step + 1}\n", "stderr": "", "exit_code": 0}
            started = time.perf_counter()
            found = client.lookup(task, history, call, rollout_id=f"{run}-c{r}", claim=True, resume=False)
            lookup_ms = (time.perf_counter() - started) * 1000
            if found.hit:
                raise SystemExit(f"client rollout {r} step {step} was a hit: every call of this workload must miss")
            started = time.perf_counter()
            client.record(task, history, call, result, 1.0, rollout_id=f"{run}-c{r}", mutated=True)
            record_ms = (time.perf_counter() - started) * 1000
            misses.append(
                {"rollout": r, "step": step, "lookup_ms": round(lookup_ms, 3), "record_ms": round(record_ms, 3)}
            )
            history.append(call)
    return misses


def summary(misses: list[dict], first: bool) -> dict:
    chosen = [m for m in misses if (m["step"] == 0) == first]
    if not chosen:
        return {}
    diffs = [m["miss_ms"] - m["direct_ms"] for m in chosen]
    phases: dict[str, list[float]] = {}
    for m in chosen:
        for name, ms in m["phases_ms"].items():
            phases.setdefault(name, []).append(ms)
    return {
        "misses": len(chosen),
        "miss_ms": _quantiles([m["miss_ms"] for m in chosen]),
        "direct_ms": _quantiles([m["direct_ms"] for m in chosen]),
        "paired_diff_ms": _quantiles(diffs),
        # a phase a miss did not go through counts 0 in its median
        "phases_p50_ms": {
            name: round(percentile(values + [0.0] * (len(chosen) - len(values)), 50), 3)
            for name, values in sorted(phases.items())
        },
    }


def _quantiles(values: list[float]) -> dict:
    return {"p50": round(percentile(values, 50), 3), "p95": round(percentile(values, 95), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=6)
    parser.add_argument("--calls", type=int, default=30, help="state-changing calls per rollout")
    parser.add_argument("--workers", type=int, default=2, help="uvicorn workers")
    parser.add_argument("--served-from", type=Path, default=ROOT, help="the checkout whose service is measured")
    parser.add_argument("--label", default="", help="a name for this run in the report (e.g. before, after)")
    parser.add_argument("--out", type=Path, default=ROOT / "artifacts" / "bench")
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tvcache_site.settings")
    django.setup()  # the lab's own containers use the service's docker backend
    from tvclient import TVCacheClient

    served_from = args.served_from.resolve()
    token = token_made(served_from)
    run = uuid.uuid4().hex[:8]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=served_from, capture_output=True, text=True, check=False
    ).stdout.strip()
    load = os.getloadavg()[0]
    env = {**os.environ, "PYTHONPATH": str(served_from)}
    os.environ.update(env)
    with service_running(workers=args.workers, root=served_from, celery=bool(os.environ.get("REDIS_URL"))) as service:
        client = TVCacheClient(service.url, token, timeout=120)
        server = tool_server_arm(client, f"misses-{run}", args.rollouts, args.calls, run)
        lookups = client_arm(client, f"misses-client-{run}", args.rollouts, args.calls, run)
    figures = {
        "meta": {
            "label": args.label,
            "served_from": str(served_from),
            "commit": commit,
            "workers": args.workers,
            "rollouts": args.rollouts,
            "calls": args.calls,
            "cores": os.cpu_count(),
            "load_before": round(load, 2),
            "load_after": round(os.getloadavg()[0], 2),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "tool_server": {"steady": summary(server, first=False), "first": summary(server, first=True)},
        "client": {
            "lookup_ms": _quantiles([m["lookup_ms"] for m in lookups]),
            "record_ms": _quantiles([m["record_ms"] for m in lookups]),
        },
        "misses": server,
        "client_misses": lookups,
    }
    write(args.out, figures)


def write(out: Path, figures: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    name = f"misses-{figures['meta']['label']}" if figures["meta"]["label"] else "misses"
    (out / f"{name}.json").write_text(json.dumps(figures, indent=2))
    meta, steady, first = figures["meta"], figures["tool_server"]["steady"], figures["tool_server"]["first"]
    lines = [
        (
            f"Served from {meta['commit']} ({meta['workers']} uvicorn workers), {meta['cores']} cores; "
            f"{meta['rollouts']} rollouts x {meta['calls']} state-changing calls, each miss paired with a direct "
            f"call through a session agent; load average {meta['load_before']} before, {meta['load_after']} after."
        ),
        "",
        "| misses | n | miss P50 / P95 ms | direct P50 / P95 ms | miss - direct, paired, P50 / P95 ms |",
        "|---|---:|---|---|---|",
    ]
    for label, row in (("steady (own sandbox)", steady), ("first of a rollout", first)):
        if row:
            lines.append(
                f"| {label} | {row['misses']} | {row['miss_ms']['p50']} / {row['miss_ms']['p95']} "
                f"| {row['direct_ms']['p50']} / {row['direct_ms']['p95']} "
                f"| **{row['paired_diff_ms']['p50']}** / {row['paired_diff_ms']['p95']} |"
            )
    client = figures["client"]
    lines += [
        "",
        f"Client mode: miss lookup P50 {client['lookup_ms']['p50']} ms, **P95 {client['lookup_ms']['p95']} ms**; "
        f"record P50 {client['record_ms']['p50']} ms, P95 {client['record_ms']['p95']} ms.",
        "",
        "Steady misses, the service's phases (median, a phase not gone through counting 0): "
        + ", ".join(f"{k} {v}" for k, v in steady.get("phases_p50_ms", {}).items()),
    ]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
