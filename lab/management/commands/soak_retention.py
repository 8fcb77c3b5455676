"""A simulated long training run against tasks with a retention policy: does the database hold at
the budget, do lookups stay flat, is nothing lost that was not evicted (docs/operations/retention.md).

    python manage.py soak_retention --tasks 64 --rollouts 8 --steps 300 --calls 20 --max-nodes 2000

Drives lookups and records through the services (lab/bench/retention.py), --drivers at a time (a
thread and a connection each, the tasks split between them), rollouts of a task sharing their first
calls, the popular calls moving on every --drift steps; the periodic jobs (snapshot
budgets and retention, vacuum) run beside it in a thread, as deployed. Every --checkpoint-steps
steps it writes a row: the tables' and database's sizes, nodes against the budget, lookup p50 and
p99, hit rate, every hit checked against the recorded bytes, the recorded paths that missed since
(evicted, or lost: a defect), and a sampled audit of recorded paths. Writes
artifacts/bench/retention.json (--out) after every checkpoint. Stops by itself after --steps or
--minutes, whichever comes first. Removes its tasks at the end unless --keep."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand

from lab.bench.retention import Jobs, Soak, Workload


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser):
        parser.add_argument("--tasks", type=int, default=64)
        parser.add_argument("--rollouts", type=int, default=8, help="rollouts per task and step")
        parser.add_argument("--steps", type=int, default=300, help="training steps")
        parser.add_argument("--calls", type=int, default=20, help="calls per rollout")
        parser.add_argument("--max-nodes", type=int, default=2000, help="each task's retention bound (0: none)")
        parser.add_argument("--max-result-bytes", type=int, default=0, help="each task's bound of bytes (0: none)")
        parser.add_argument("--drift", type=int, default=10, help="steps between moves of the popular calls")
        parser.add_argument("--share", type=float, default=0.9, help="a j-th call is a popular one: share ** j")
        parser.add_argument("--live-seconds", type=float, default=10.0, help="TVCACHE_RETENTION_LIVE_S for the run")
        parser.add_argument(
            "--history-keep-seconds", type=float, default=60.0, help="TVCACHE_HISTORY_KEEP_S for the run (0: keep)"
        )
        parser.add_argument("--collect-seconds", type=float, default=10.0, help="period of the retention job")
        parser.add_argument("--vacuum-seconds", type=float, default=60.0)
        parser.add_argument("--reindex-seconds", type=float, default=600.0, help="period of the index rebuild job")
        parser.add_argument("--checkpoint-steps", type=int, default=5)
        parser.add_argument("--sample", type=int, default=4000, help="recorded paths audited at each checkpoint")
        parser.add_argument(
            "--synchronous-commit",
            action="store_true",
            help="records wait for the disk (default: not, so that a run's calls are not all fsyncs)",
        )
        parser.add_argument("--minutes", type=float, default=20.0, help="stop after this long")
        parser.add_argument("--seed", type=int, default=1)
        parser.add_argument(
            "--drivers",
            type=int,
            default=1,
            help="drivers side by side, a thread and a connection each, the tasks split",
        )
        parser.add_argument("--keep", action="store_true", help="keep the soak's tasks")
        parser.add_argument("--out", default=str(Path(settings.BASE_DIR) / "artifacts" / "bench" / "retention.json"))

    def handle(self, *args, **options):
        settings.TVCACHE["RETENTION_LIVE_S"] = options["live_seconds"]  # this process runs the job
        settings.TVCACHE["HISTORY_KEEP_S"] = options["history_keep_seconds"]
        soak = Soak(
            tasks=options["tasks"],
            rollouts=options["rollouts"],
            workload=Workload(calls=options["calls"], share=options["share"], drift=options["drift"]),
            max_nodes=options["max_nodes"] or None,
            max_result_bytes=options["max_result_bytes"] or None,
            sample=options["sample"],
            seed=options["seed"],
            drivers=options["drivers"],
        )
        soak.setup(synchronous_commit=options["synchronous_commit"])
        report = {
            "command": "manage.py soak_retention",
            "options": options,
            "cpus": os.cpu_count(),
            "checkpoints": [],
        }
        out = Path(options["out"])
        started = time.monotonic()
        deadline = started + options["minutes"] * 60
        step = 0
        try:
            with Jobs(
                collect_every_s=options["collect_seconds"],
                vacuum_every_s=options["vacuum_seconds"],
                reindex_every_s=options["reindex_seconds"],
            ) as jobs:
                for step in range(1, options["steps"] + 1):
                    finished = soak.step(step - 1, deadline)
                    if not finished or step % options["checkpoint_steps"] == 0 or step == options["steps"]:
                        row = soak.checkpoint(step, jobs, time.monotonic() - started)
                        report["checkpoints"].append(row)
                        _write(out, report)
                        self.stdout.write(_line(row, options["max_nodes"]))
                    if not finished:
                        report["stopped"] = f"--minutes {options['minutes']} spent during step {step}"
                        self.stdout.write(report["stopped"])
                        break
            report["totals"] = dict(vars(soak.totals))
            report["steps_done"] = step
            _write(out, report)
        finally:
            soak.teardown(keep=options["keep"])
        self.stdout.write(f"totals: {report.get('totals')}")
        self.stdout.write(f"wrote {out}")


def _line(row: dict, budget: int) -> str:
    nodes, sizes, totals = row["nodes"], row["sizes_bytes"], row["totals"]
    return (
        f"step {row['step']:>4} {row['elapsed_s']:>7}s  nodes {nodes['total']:>8,} (max/task {nodes['max_per_task']:,}"
        f" / {budget:,})  cache_node {sizes.get('cache_node', 0) / 2**20:7.1f} MiB  db {sizes['database'] / 2**20:7.1f}"
        f" MiB  lookup p50 {row['lookup_p50_ms']} p99 {row['lookup_p99_ms']} ms  hit {row['hit_rate']:.0%}"
        f"  evicted {row['retention']['nodes_evicted']:,}  expired {row['retention']['rollouts_expired']:,}  wrong {totals['wrong_hits']}  lost {totals['lost']}"
        f"  evicted-missed {totals['evicted_misses']:,}"
    )


def _write(out: Path, report: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
