"""Each framework's own workload three ways: uncached, a first pass and a repeat pass through
tvcache, with wall time, tool time and the calls that really ran.

Serves tvcache as deployed (uvicorn, 2 workers) and runs each framework's driver
(lab/frameworks/) in the framework's venv (lab/frameworks/venvs.py), as the integration tests
do: SkyRL's generator path over skyrl-gym's SQLEnv, veRL's ToolAgentLoop, Tinker's
do_group_rollout, and a real `harbor run` trial whose solve.sh sleeps 4 s. Each driver also
checks that the cached passes saw what the uncached one saw; a run that did not is reported, not
hidden. Writes artifacts/bench/frameworks.json (the drivers' documents) and
docs/results/bench/frameworks.md (the table).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand

from accounts.services.tokens import token_create
from lab.frameworks.venvs import DRIVERS, ROOT, Framework
from lab.server import service_running

Row = dict[str, Any]


def skyrl(env: dict[str, str]) -> tuple[dict, list[Row]]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lab.frameworks.skyrl_rollouts",
            "--scenarios",
            "sql,notes",
            "--passes",
            "2",
            "--instances",
            "8",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    document = json.loads(done.stdout)
    rows = []
    for name, scenario in document["scenarios"].items():
        first = scenario["runs"]["cached-1"]["counters"]
        for run, label in (("uncached", "uncached"), ("cached-1", "first"), ("cached-2", "repeat")):
            result = scenario["runs"][run]
            counters = result["counters"]
            # The tools' own counter where the scenario has one; else the executors' (the
            # uncached run ran every call the first pass looked up).
            executed = (
                result["tool_calls"]
                if result["tool_calls"] is not None
                else counters.get("executed", 0) + counters.get("replayed", 0)
                if counters
                else first["hits"] + first["misses"]
            )
            rows.append(
                {
                    "framework": "SkyRL",
                    "workload": f"{name}, 8 trajectories",
                    "pass": label,
                    "wall_s": result["wall_ms"] / 1000,
                    "tool_s": None,
                    "executed": executed,
                    "hits": counters.get("hits"),
                    "identical": scenario.get("identical", {}).get(run, True),
                }
            )
    return document, rows


def verl(env: dict[str, str]) -> tuple[dict, list[Row]]:
    document = _driver("verl", "verl_rollouts.py", ["--samples", "4", "--rollouts", "4"], env)
    rows = []
    for label, result in document["passes"].items():
        service = result.get("service") or {}
        rows.append(
            {
                "framework": "veRL",
                "workload": "ToolAgentLoop, 4 samples x 4 rollouts",
                "pass": label,
                "wall_s": result["wall_s"],
                "tool_s": result["tool_s"],
                "executed": sum(result["executed"].values()),
                "hits": service.get("hits"),
                "identical": result["trajectories"] == document["passes"]["uncached"]["trajectories"],
            }
        )
    return document, rows


def tinker(env: dict[str, str]) -> tuple[dict, list[Row]]:
    document = _driver("tinker", "tinker_rollouts.py", ["--mode", "both", "--passes", "2"], env)
    rows = []
    uncached = document["passes"][0]
    for label, result in zip(("uncached", "first", "repeat"), document["passes"]):
        rows.append(
            {
                "framework": "Tinker",
                "workload": "do_group_rollout, a group of 3",
                "pass": label,
                "wall_s": result["wall_ms"] / 1000,
                "tool_s": result["tool_ms"] / 1000,
                "executed": sum(result["ran"].values()),
                "hits": (result.get("executor") or {}).get("hits"),
                "identical": (result["group_repr"], result["trajectories"])
                == (uncached["group_repr"], uncached["trajectories"]),
            }
        )
    return document, rows


def harbor(env: dict[str, str]) -> tuple[dict, list[Row]]:
    document = _driver("harbor-0.26", "harbor_trials.py", ["--passes", "uncached,first,repeat"], env)
    rows = []
    for label, result in document["passes"].items():
        service = result.get("service") or {}
        rows.append(
            {
                "framework": "Harbor 0.26",
                "workload": "harbor run, solve.sh sleeps 4 s",
                "pass": label,
                "wall_s": result["trials"][0]["trial_s"],
                "tool_s": None,
                "executed": len(result["sandbox_operations"]) // (2 if label == "uncached" else 1),
                "hits": service.get("hits"),
                "solve_runs": result["solve_runs"],
                "identical": not document.get("differences", {}).get(label),
            }
        )
    return document, rows


FRAMEWORKS: dict[str, Callable[[dict[str, str]], tuple[dict, list[Row]]]] = {
    "skyrl": skyrl,
    "verl": verl,
    "tinker": tinker,
    "harbor": harbor,
}


def _driver(framework: str, script: str, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """The JSON document (its last line of output) a driver prints, run in the framework's venv."""
    done = Framework.named(framework).run([str(DRIVERS / script), *args], env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the {framework} driver failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[Row]) -> str:
    lines = [
        "| framework | workload | pass | wall s | tool s | calls run | hits | same as uncached |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        tool = "" if row["tool_s"] is None else f"{row['tool_s']:.3f}"
        same = ("yes" if row["identical"] else "**no**") if row["pass"] != "uncached" else ""
        lines.append(
            f"| {row['framework']} | {row['workload']} | {row['pass']} | {row['wall_s']:.3f} | {tool} "
            f"| {row['executed']} | {row['hits'] if row['hits'] is not None else ''} | {same} |"
        )
    return "\n".join(lines)


class Command(BaseCommand):
    help = __doc__.split("\n\n")[0]

    def add_arguments(self, parser):
        parser.add_argument("--only", default=",".join(FRAMEWORKS), help="frameworks, comma-separated")
        parser.add_argument("--out", default="artifacts/bench")

    def handle(self, *args, only: str, out: str, **options):
        out_dir = ROOT / out
        out_dir.mkdir(parents=True, exist_ok=True)
        documents: dict[str, Any] = {}
        rows: list[Row] = []
        with service_running(workers=2, redis_url="") as service:
            env = {
                **os.environ,
                "TVCACHE_URL": service.url,
                "TVCACHE_TOKEN": token_create(name=f"bench-{uuid.uuid4().hex[:8]}"),
            }
            for name in only.split(","):
                self.stderr.write(f"[bench_frameworks] {name}")
                documents[name], more = FRAMEWORKS[name](env)
                rows += more
        (out_dir / "frameworks.json").write_text(json.dumps({"rows": rows, "documents": documents}, indent=1))
        markdown = (
            "# Frameworks: uncached, first and repeat pass\n\n"
            "`python manage.py bench_frameworks` (lab/management/commands/bench_frameworks.py); "
            "tvcache served as deployed (uvicorn, 2 workers) on this machine. Wall s: the pass "
            "(Harbor: the trial, from its result.json). Tool s: time inside the tools, where the "
            "driver measures it. Calls run: tool calls (Harbor: sandbox operations) that really "
            "ran.\n\n" + table(rows) + "\n"
        )
        (out_dir / "frameworks.md").write_text(markdown)
        results = ROOT / "docs" / "results" / "bench"
        results.mkdir(parents=True, exist_ok=True)
        (results / "frameworks.md").write_text(markdown)
        self.stdout.write(markdown)
