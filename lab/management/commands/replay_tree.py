"""Replay the terminal or sql workload as tree search: each rollout branches into continuations at a
step, recursively, with no cache (each branch replays its prefix in a fresh sandbox), in tool-server
mode (POST .../branches) and in client mode (ToolCallExecutor.branch), side by side; branch
readiness, trajectories per sandbox-second and the exactness of every answer
(docs/lab/tree-search-replay.md)."""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path

from django.core.management.base import CommandError

from cache.inputs import MAX_BRANCHES
from lab.replay.arms import Arm
from lab.replay.command import ReplayCommand
from lab.replay.metering import TimedClient
from lab.replay.report import build_report, headline, write_report
from lab.replay.sql import SqlWorkload
from lab.replay.terminal import TerminalWorkload
from lab.replay.tree import TreeConfig, TreeReplay, TreeShape, tree_headline, tree_report
from lab.replay.workload import Workload


class Command(ReplayCommand):
    help = __doc__
    workload_name = "tree"
    default_tasks = 2
    default_rollouts = 2
    default_epochs = 2
    default_arms = "nocache,server,client"
    default_concurrency = 1  # trees in flight: all of a tree's trajectories run at once

    def add_arguments(self, parser):
        super().add_arguments(parser)
        concurrency = next(action for action in parser._actions if action.dest == "concurrency")
        concurrency.help = "trees in flight at once; every trajectory of a tree runs as soon as it is opened"
        parser.add_argument("--workload", choices=("terminal", "sql"), default="terminal")
        parser.add_argument("--branch-count", type=int, default=4, help="continuations per branch point")
        parser.add_argument(
            "--branch-depth", type=int, default=2, help="levels of branches below the roots (0: no branching)"
        )
        parser.add_argument(
            "--branch-at",
            default="",
            help="comma-separated: after how many of its own calls a trajectory of each level branches "
            "(root first; the last value repeats; clamped to its calls); default: a seeded choice per trajectory",
        )
        parser.add_argument(
            "--step-bucket", type=int, default=4, help="width of the buckets of k (the branch step) in the report"
        )
        parser.add_argument("--task-names", default="", help="terminal: comma-separated task names")
        parser.add_argument(
            "--direct-calls",
            choices=("exec", "session"),
            default="exec",
            help="terminal: how the lab's own containers run a call (replay_terminal --help)",
        )
        parser.add_argument("--latency-ms", type=float, default=50.0, help="sql: added per executed query")
        parser.add_argument("--rows", type=int, default=1500, help="sql: orders per database")

    def make_workload(self, options) -> Workload:
        if options["workload"] == "sql":
            return SqlWorkload(
                tasks=options["tasks"],
                rollouts=options["rollouts"],
                seed=options["seed"],
                latency_ms=options["latency_ms"],
                rows=options["rows"],
            )
        return TerminalWorkload(
            tasks=options["tasks"],
            rollouts=options["rollouts"],
            seed=options["seed"],
            names=[n.strip() for n in options["task_names"].split(",") if n.strip()],
            direct_calls=options["direct_calls"],
        )

    def workload_config(self, options):
        if options["workload"] == "sql":
            return {"latency_ms": options["latency_ms"], "rows": options["rows"]}
        return {"task_names": options["task_names"], "direct_calls": options["direct_calls"]}

    @staticmethod
    def _shape(options) -> TreeShape:
        try:
            at = tuple(int(v) for v in options["branch_at"].split(",") if v.strip())
        except ValueError:
            raise CommandError("--branch-at takes comma-separated numbers of calls") from None
        if not 1 <= options["branch_count"] <= MAX_BRANCHES:
            raise CommandError(f"--branch-count must be 1 to {MAX_BRANCHES}")
        if options["branch_depth"] < 0 or any(n < 1 for n in at) or options["step_bucket"] < 1:
            raise CommandError("--branch-depth must be 0 or more; --branch-at and --step-bucket values 1 or more")
        return TreeShape(options["branch_count"], options["branch_depth"], at)

    def handle(self, *args, **options):
        if options["faults"]:
            raise CommandError("the tree replay has no fault arm: use replay_terminal or replay_sql --faults")
        shape = self._shape(options)
        arms = [Arm.parse(a.strip()) for a in options["arms"].split(",") if a.strip()]
        if not any(a.mode == "nocache" for a in arms):
            arms.insert(0, Arm("nocache", "nocache"))
        arms.sort(key=lambda a: a.mode != "nocache")  # the fresh executions first, every epoch
        started_at = dt.datetime.now(dt.UTC)
        when = started_at.strftime("%Y%m%dt%H%M%S") + (f"-{options['tag']}" if options["tag"] else "")
        stamp = f"tree-{when}"
        out_dir = Path(options["out"])
        config = {
            key: options[key]
            for key in ("workload", "tasks", "rollouts", "epochs", "seed", "concurrency", "think_ms", "warm_wait_s")
        }
        config.update(
            arms=[a.name for a in arms],
            audit_rate=options["audit_rate"],
            tree=shape.describe(),
            step_bucket=options["step_bucket"],
            **self.workload_config(options),
        )
        workload = self.make_workload(options)
        try:
            with self._service(options, out_dir) as (url, token, service):
                with TimedClient(url, token, timeout=600) as client:
                    replay = TreeReplay(
                        workload,
                        client,
                        TreeConfig(
                            epochs=options["epochs"],
                            arms=arms,
                            concurrency=options["concurrency"],
                            seed=options["seed"],
                            run_tag="tree" + when.replace("t", ""),
                            shape=shape,
                            think_ms=options["think_ms"],
                            warm_wait_s=options["warm_wait_s"],
                            audit_rate=options["audit_rate"],
                        ),
                    )
                    began = time.perf_counter()
                    try:
                        replay.run()
                    finally:
                        if service is not None:
                            self._release(replay.arm_tasks.server_ids())
                    report = build_report(
                        replay,
                        workload=options["workload"],
                        config=config,
                        started_at=started_at,
                        seconds=time.perf_counter() - began,
                        server={"url": url, "started_here": service is not None},
                    )
                    report["replay"] = "tree"
                    report["tree"] = tree_report(replay, step_bucket=options["step_bucket"])
        finally:
            workload.close()
        path = write_report(report, out_dir, stamp)
        if not options["no_plots"]:
            from lab.replay.plots import write_plots

            report["plots"] = write_plots(report, out_dir, stamp)
            path.write_text(json.dumps(report, indent=1, default=str))
        self.stdout.write(headline(report))
        self.stdout.write(tree_headline(report))
        self.stdout.write(json.dumps(report["tree"]["comparison"], indent=1))
        self.stdout.write(f"report: {path}")
        for plot in report["plots"]:
            self.stdout.write(f"plot: {plot}")
