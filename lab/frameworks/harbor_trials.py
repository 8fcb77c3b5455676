"""Driver: real `harbor run` trials of a tiny task, uncached and through tvcache, in this venv's
Harbor (run it with a harbor venv's python; tvclient and lab/frameworks on PYTHONPATH, as
`Framework.run` sets them).

Passes (`--passes`, in order):
- `uncached`: two trials, each a `harbor run` of its own (run at once), with the plain
  `harbor_local:LocalFolderEnvironment`. What differs between the two is what differs between
  any two trials (ids, names, times): `varying` lists those JSON fields.
- `first`, `repeat`: one trial each through tvcache, by `--command` (by default the command of
  docs/integrations/harbor.md), with `harbor_local:CachedLocalFolder` against TVCACHE_URL and
  TVCACHE_TOKEN.

Each cached trial's folder (every file's name, kind, mode and bytes; its JSON files parsed) is
compared with the first uncached trial's, less the `varying` fields and with the uncached
trial's environment import path read as the cached one (the one input that differs).
Counters per pass: solve.sh's runs (lines it appended to the probe folder, outside the
sandboxes), the operations that really ran in the pass's sandboxes (harbor_local's log; those of
start() apart), and the service's calls, hits, executions and saved_ms for the task. Timings: each `harbor run`'s
wall time and the trial's own (result.json's started_at to finished_at).

Prints one JSON document. `--label` makes the task (and so its tvcache task) distinct; by
default a fresh one per run.

    python harbor_trials.py --passes uncached,first,repeat
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import json
import os
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import harbor_task

from tvclient import TVCacheClient

UNCACHED_CLASS = "harbor_local:LocalFolderEnvironment"
CACHED_CLASS = "harbor_local:CachedLocalFolder"
# The command docs/integrations/harbor.md shows (the test passes the docs' own text).
COMMAND = (
    'harbor run -p "$TASK" -a oracle --env harbor_local:CachedLocalFolder '
    '--ek probe_dir="$PROBE" -o "$JOBS" --job-name "$JOB" -n 1 -y -q'
)
UNCACHED_COMMAND = COMMAND.replace(CACHED_CLASS, UNCACHED_CLASS)
VARYING = "<varies between any two trials>"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", default="uncached,first,repeat")
    parser.add_argument(
        "--command", default=COMMAND, help="the cached passes' shell command ($TASK, $PROBE, $JOBS, $JOB)"
    )
    parser.add_argument(
        "--work", type=Path, help="folder for the task, probe and jobs, kept (default: a temporary one, removed)"
    )
    parser.add_argument("--label", default=uuid.uuid4().hex[:12], help="makes the task, and its tvcache task, distinct")
    parser.add_argument(
        "--varying",
        default="",
        help="comma-separated JSON fields that vary between any two trials by nature (ids, names, times): "
        "left out of the comparison even where the two uncached trials happen to agree on them",
    )
    args = parser.parse_args()
    if args.work is not None:
        run(args, args.work)
        return
    with tempfile.TemporaryDirectory(prefix="harbor-trials-") as work:
        run(args, Path(work))


def run(args: argparse.Namespace, work: Path) -> None:
    task = harbor_task.write_task(work / f"hello-cache-{args.label}", label=args.label)
    probe = work / "probe"
    probe.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "harbor": version("harbor"),
        "work": str(work),
        "task": task.name,
        "import_paths": import_paths(),
        "passes": {},
    }
    client = (
        TVCacheClient(os.environ["TVCACHE_URL"], os.environ["TVCACHE_TOKEN"])
        if {"first", "repeat"} & set(args.passes.split(","))
        else None
    )
    for name in args.passes.split(","):
        report["passes"][name] = run_pass(name, args.command, task, probe, work / "jobs", client)
    compare(report, known=[field for field in args.varying.split(",") if field])
    print(json.dumps(report))


def import_paths() -> dict[str, Any]:
    """How Harbor's own import machinery resolves `Cached<Type>` paths in this release."""
    from harbor.environments import factory
    from harbor.environments.base import BaseEnvironment
    from harbor.utils.import_path import import_class

    resolved = {}
    for path in (
        "tvclient.integrations.harbor:CachedDocker",
        "tvclient.integrations.harbor:CachedDaytona",
        CACHED_CLASS,
    ):
        try:
            get = getattr(factory.EnvironmentFactory, "get_environment_class", None)
            environment_class = get(import_path=path) if get else import_class(path, label="environment")
            resolved[path] = {
                "class": environment_class.__name__,
                "bases": [base.__name__ for base in environment_class.__mro__[1:3]],
                "environment": issubclass(environment_class, BaseEnvironment),
            }
        except Exception as exc:  # noqa: BLE001 - reported, the test asserts on it
            resolved[path] = {"error": f"{type(exc).__name__}: {exc}"}
    return resolved


def run_pass(
    name: str, command: str, task: Path, probe: Path, jobs: Path, client: TVCacheClient | None
) -> dict[str, Any]:
    solve_runs, operations = _lines(probe / "solve-runs"), _lines(probe / "operations.jsonl")
    stats_before = _stats(client, task.name)
    jobs_named = [f"{name}-a", f"{name}-b"] if name == "uncached" else [name]
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(jobs_named)) as pool:
        runs = list(
            pool.map(
                lambda job: harbor_run(UNCACHED_COMMAND if name == "uncached" else command, task, probe, jobs, job),
                jobs_named,
            )
        )
    wall_s = time.perf_counter() - started
    trials = [trial(path) for job in jobs_named for path in sorted((jobs / job).glob("*/result.json"))]
    sessions = {f"{entry['trial_name']}__env" for entry in trials}
    ran = [json.loads(line) for line in _read_lines(probe / "operations.jsonl")[operations:]]
    stats_after = _stats(client, task.name)
    return {
        "wall_s": round(wall_s, 3),
        "runs": runs,
        "trials": trials,
        "solve_runs": _lines(probe / "solve-runs") - solve_runs,
        "sandbox_operations": [
            entry for entry in ran if entry["session"] in sessions and entry.get("phase") != "start"
        ],
        "start_operations": len([entry for entry in ran if entry.get("phase") == "start"]),
        "service": {
            key: round(stats_after.get(key, 0) - stats_before.get(key, 0), 3)
            for key in ("calls", "hits", "executions", "saved_ms")
        }
        if client
        else None,
    }


def harbor_run(command: str, task: Path, probe: Path, jobs: Path, job: str) -> dict[str, Any]:
    variables = {
        **os.environ,
        "TASK": str(task),
        "PROBE": str(probe),
        "JOBS": str(jobs),
        "JOB": job,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        # No network here: no telemetry, and LiteLLM's price list from its package.
        "HARBOR_TELEMETRY": "0",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    started = time.perf_counter()
    done = subprocess.run(
        ["bash", "-c", command], env=variables, capture_output=True, text=True, timeout=300, check=False
    )
    return {
        "job": job,
        "returncode": done.returncode,
        "wall_s": round(time.perf_counter() - started, 3),
        "output": (done.stdout + done.stderr)[-3000:] if done.returncode else "",
    }


def trial(result_path: Path) -> dict[str, Any]:
    folder = result_path.parent
    result = json.loads(result_path.read_text())
    agent = result.get("agent_execution") or {}
    return {
        "trial_name": result["trial_name"],
        "reward": (result.get("verifier_result") or {}).get("rewards"),
        "exception": result.get("exception_info"),
        "trial_s": _seconds(result.get("started_at"), result.get("finished_at")),
        "agent_execution_s": _seconds(agent.get("started_at"), agent.get("finished_at")),
        "files": snapshot(folder),
    }


def snapshot(folder: Path) -> dict[str, Any]:
    """Every entry under `folder`: kind, mode, and bytes (JSON files parsed; text as text)."""
    entries: dict[str, Any] = {}
    for path in sorted(folder.rglob("*")):
        name, info = path.relative_to(folder).as_posix(), path.lstat()
        entry: dict[str, Any] = {"mode": oct(stat.S_IMODE(info.st_mode))}
        if path.is_symlink():
            entry.update(kind="link", target=os.readlink(path))
        elif path.is_dir():
            entry.update(kind="dir")
        else:
            data = path.read_bytes()
            entry["kind"] = "file"
            if path.suffix == ".json":
                entry["json"] = json.loads(data)
            else:
                try:
                    entry["text"] = data.decode()
                except UnicodeDecodeError:
                    entry["base64"] = base64.b64encode(data).decode()
        entries[name] = entry
    return entries


def compare(report: dict[str, Any], known: list[str] = ()) -> None:
    """`varying`: the JSON fields that differ between the two uncached trials; `differences`: what
    differs between each cached trial and the first uncached one, less those and the `known` ones
    (two trials run at once may agree on a time by chance)."""
    passes = report["passes"]
    uncached = passes.get("uncached", {}).get("trials", [])
    if len(uncached) < 2:
        return
    a, b = uncached[0]["files"], uncached[1]["files"]
    report["varying"] = sorted(set(_differing(a, b)))
    varying = sorted(set(report["varying"]) | set(known))
    reference = _masked(_as_cached(a), varying)
    report["differences"] = {
        name: [path for path in _differing(reference, _masked(entry["files"], varying))]
        for name, result in passes.items()
        if name != "uncached"
        for entry in result["trials"]
    }


def _differing(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        found = []
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                found.append(f"{path}/{key}")
            else:
                found += _differing(a[key], b[key], f"{path}/{key}")
        return found
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [found for index, (x, y) in enumerate(zip(a, b)) for found in _differing(x, y, f"{path}/{index}")]
    return [] if a == b and type(a) is type(b) else [path]


def _masked(value: Any, varying: list[str], path: str = "") -> Any:
    if path in varying:
        return VARYING
    if isinstance(value, dict):
        return {key: _masked(item, varying, f"{path}/{key}") for key, item in value.items()}
    if isinstance(value, list):
        return [_masked(item, varying, f"{path}/{index}") for index, item in enumerate(value)]
    return value


def _as_cached(value: Any) -> Any:
    """The uncached trial's files as the cached trials' would read: their environment import
    path names the cached class (the input that differs), all else as it is."""
    if isinstance(value, dict):
        return {key: _as_cached(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_cached(item) for item in value]
    return CACHED_CLASS if value == UNCACHED_CLASS else value


def _stats(client: TVCacheClient | None, task_name: str) -> dict[str, Any]:
    if client is None:
        return {}
    tasks = [task for task in client.list_tasks(search=task_name) if task["id"].startswith(task_name)]
    return client.stats(tasks[0]["id"]) if tasks else {}


def _seconds(started: str | None, finished: str | None) -> float | None:
    if not started or not finished:
        return None
    return round((datetime.fromisoformat(finished) - datetime.fromisoformat(started)).total_seconds(), 3)


def _read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _lines(path: Path) -> int:
    return len(_read_lines(path))


if __name__ == "__main__":
    main()
