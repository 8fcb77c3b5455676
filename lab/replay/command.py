"""What the replay_* management commands share: options, the service, the report and plots."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from .arms import Arm
from .faults import FaultPlan
from .harness import Replay, ReplayConfig
from .metering import TimedClient
from .report import breakdown, build_report, fault_headline, headline, write_report
from .workload import Workload

DEFAULT_OUT = Path(settings.BASE_DIR) / "artifacts" / "replay"


def _commit(checkout: Path) -> str | None:
    """The commit a checkout is at (a dirty tree is marked), or None outside git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


class ReplayCommand(BaseCommand):
    workload_name = ""
    default_arms = "nocache,client,server"
    default_tasks = 3
    default_rollouts = 8
    default_epochs = 3
    default_concurrency = 4
    default_think_ms = 100.0

    def add_arguments(self, parser):
        parser.add_argument("--url", help="a running tvcache; default: start one (uvicorn + a Celery worker)")
        parser.add_argument("--token", help="API token for --url; default: create one")
        parser.add_argument(
            "--serve",
            help="the checkout to serve (default: this one), to measure another revision side by side "
            "with this one: its schema must be this database's (give each run a database of its own)",
        )
        parser.add_argument("--tasks", type=int, default=self.default_tasks)
        parser.add_argument("--rollouts", type=int, default=self.default_rollouts, help="rollouts per task and epoch")
        parser.add_argument("--epochs", type=int, default=self.default_epochs)
        parser.add_argument("--seed", type=int, default=1)
        parser.add_argument(
            "--arms",
            default=self.default_arms,
            help="comma-separated: nocache (always run), client, server; -b<N> sets a snapshot "
            "budget of N per task, e.g. server-b8",
        )
        parser.add_argument(
            "--concurrency", type=int, default=self.default_concurrency, help="rollouts in flight at once"
        )
        parser.add_argument(
            "--think-ms",
            type=float,
            default=self.default_think_ms,
            help="the policy's generation time before each call, mean (0.5x to 1.5x, seeded, the "
            "same in every arm); 0: back-to-back calls, a stress test",
        )
        parser.add_argument(
            "--warm-wait-s",
            type=float,
            default=5.0,
            help="tool-server mode: wait up to this long after announcing a step",
        )
        parser.add_argument("--out", default=str(DEFAULT_OUT))
        parser.add_argument("--no-plots", action="store_true")
        parser.add_argument("--tag", default="", help="added to task ids and output names")
        parser.add_argument(
            "--faults",
            action="store_true",
            help="the fault arm: seeded timeouts, environment errors, sandbox deaths and a service "
            "restart per arm (the restart needs a service started here: not with --url); the "
            "report adds wrong answers, divergences and the hit-rate cost (lab/replay/faults.py)",
        )
        parser.add_argument(
            "--audit-rate",
            type=float,
            default=None,
            help="the tasks' determinism-audit rate (0 to 1); default: the service's (0.02)",
        )
        parser.add_argument(
            "--match",
            choices=["history", "state"],
            default=None,
            help="the tasks' matching: history (longest prefix) or state (also a state with the same verified "
            "fingerprint); default: the service's",
        )
        parser.add_argument(
            "--fault-rate",
            type=float,
            default=0.25,
            help="with --faults: share of rollouts that meet a fault, per task and epoch",
        )

    def make_workload(self, options: dict[str, Any]) -> Workload:
        raise NotImplementedError

    def workload_config(self, options: dict[str, Any]) -> dict[str, Any]:
        return {}

    def handle(self, *args, **options):
        arms = [Arm.parse(a.strip()) for a in options["arms"].split(",") if a.strip()]
        if not any(a.mode == "nocache" for a in arms):
            arms.insert(0, Arm("nocache", "nocache"))
        arms.sort(key=lambda a: a.mode != "nocache")  # the fresh executions first, every epoch
        started_at = dt.datetime.now(dt.UTC)
        load_start = [round(x, 2) for x in os.getloadavg()]  # the machine is shared: each figure with its load
        stamp = started_at.strftime("%Y%m%dt%H%M%S") + (f"-{options['tag']}" if options["tag"] else "")
        out_dir = Path(options["out"])
        workload = self.make_workload(options)
        config = {
            key: options[key]
            for key in (
                "tasks",
                "rollouts",
                "epochs",
                "seed",
                "concurrency",
                "think_ms",
                "warm_wait_s",
                "faults",
                "audit_rate",
                "match",
            )
        }
        config.update(arms=[a.name for a in arms], **self.workload_config(options))
        config["served_commit"] = None if options["url"] else _commit(Path(options["serve"] or "."))
        faults = FaultPlan(seed=options["seed"], rate=options["fault_rate"]) if options["faults"] else None
        if faults is not None:
            config["fault_rate"] = faults.rate
        try:
            with self._service(options, out_dir) as (url, token, service):
                if faults is not None and service is None:
                    self.stderr.write("--faults with --url: no service restart (the replay did not start the service)")
                with TimedClient(url, token, timeout=600) as client:
                    replay = Replay(
                        workload,
                        client,
                        ReplayConfig(
                            epochs=options["epochs"],
                            arms=arms,
                            concurrency=options["concurrency"],
                            seed=options["seed"],
                            run_tag=stamp.replace("t", ""),
                            think_ms=options["think_ms"],
                            warm_wait_s=options["warm_wait_s"],
                            faults=faults,
                            audit_rate=options["audit_rate"],
                            match=options["match"],
                            restart_service=service.restart if service is not None else None,
                            keep_examples=10 if faults is not None else 5,
                        ),
                    )
                    began = time.perf_counter()
                    try:
                        replay.run()
                    finally:
                        if service is not None:
                            self._release(replay.arm_tasks.server_ids())
                    config["match"] = config["match"] or replay.arm_tasks.match  # the service's default
                    report = build_report(
                        replay,
                        workload=self.workload_name,
                        config=config,
                        started_at=started_at,
                        seconds=time.perf_counter() - began,
                        server={"url": url, "started_here": service is not None},
                    )
                    report["load_avg"]["start"] = load_start
        finally:
            workload.close()
        path = write_report(report, out_dir, stamp)
        if not options["no_plots"]:
            from .plots import write_plots

            report["plots"] = write_plots(report, out_dir, stamp)
            path.write_text(json.dumps(report, indent=1, default=str))
        self.stdout.write(headline(report))
        lines = breakdown(report)
        if lines:
            self.stdout.write(lines)
        if "faults" in report:
            self.stdout.write(fault_headline(report))
        self.stdout.write(json.dumps(report["targets"], indent=1))
        self.stdout.write(json.dumps({"miss_vs_direct": report["miss_vs_direct"], "load_avg": report["load_avg"]}))
        self.stdout.write(f"report: {path}")
        for plot in report["plots"]:
            self.stdout.write(f"plot: {plot}")
        return None

    @staticmethod
    def _release(task_ids: list[str]) -> None:
        """Stop the sandboxes and free the snapshots of the tasks a service started here ran for
        the tool-server arms: it goes with the run, and nothing would reap what its pools keep
        ready. Their results stay cached. (With --url the sandboxes are the service's to manage.)"""
        from sandboxes.services import tasks_release

        tasks_release(task_ids=task_ids)

    @contextlib.contextmanager
    def _service(self, options, out_dir: Path):
        """(url, token, the service if this command started it, else None)."""
        if options["url"]:
            if not options["token"]:
                raise CommandError("--url needs --token")
            yield options["url"], options["token"], None
            return
        from accounts.services.tokens import token_create
        from lab.server import service_running

        log_dir = out_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        token = token_create(name=f"replay-{self.workload_name}-{time.time_ns()}")
        # Proactive forks and the periodic tasks (reaping, eviction, vacuum) run as deployed.
        with service_running(
            db=settings.DATABASES["default"],
            redis_url=settings.REDIS_URL,
            celery=True,
            beat=True,
            log_dir=log_dir,
            **({"root": Path(options["serve"]).resolve()} if options["serve"] else {}),
        ) as service:
            yield service.url, token, service
