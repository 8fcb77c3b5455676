"""Flat as the graph grows: lookup (hit and miss), record, a tool-server hit, stats, the graph and
tree exports and each dashboard page, timed at each size of a graph grown in bulk, and what a node
costs on disk (docs/operations/growth.md).

    python manage.py bench_growth --sizes 10000,100000,1000000 [--tasks-mode one|many]

Seeds through the database (COPY, lab/bench/growth.py), one task or tasks of --nodes-per-task
nodes, growing step by step; at each size serves the database as deployed (`manage.py serve
--web-only`, --workers processes) and sends each operation sequentially after a warm-up: p50 and
p99 of the time to the full response. Also at each size: cache_node's bytes per node by heap,
TOAST and index, the average size of each column, and EXPLAIN (ANALYZE) of the statements that
read a task's nodes. Writes artifacts/bench/growth.json (--out) after every size and prints
operation x size with the ratios to the first size. Stops by itself: each operation within
--op-seconds, no new size once --budget-minutes have passed. Removes its tasks at the end unless
--keep."""

from __future__ import annotations

import json
import os
import platform
import time
import uuid
from pathlib import Path

import httpx
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import connection
from django.test import Client

from accounts.models import ApiToken
from accounts.services.tokens import token_create
from lab.bench.growth import Budget, GraphGrowth, measure_size, plans, ratios, storage, table
from lab.server import service_running


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser):
        parser.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated node counts, growing")
        parser.add_argument("--tasks-mode", choices=("one", "many"), default="one")
        parser.add_argument("--nodes-per-task", type=int, default=1000, help="--tasks-mode many: nodes per task")
        parser.add_argument("--requests", type=int, default=300, help="timed requests per hot-path operation")
        parser.add_argument("--page-requests", type=int, default=60, help="timed requests per read and page")
        parser.add_argument("--heavy-requests", type=int, default=5, help="timed whole-graph exports")
        parser.add_argument("--warmup", type=int, default=20)
        parser.add_argument("--op-seconds", type=float, default=60.0, help="an operation stops after this long")
        parser.add_argument("--budget-minutes", type=float, default=80.0, help="no new size after this long")
        parser.add_argument("--workers", type=int, default=2)
        parser.add_argument("--max-snapshots", type=int, default=100_000)
        parser.add_argument("--snapshot-share", type=float, default=0.1, help="of state-changing nodes")
        parser.add_argument("--rollout-share", type=float, default=0.25, help="groups seeded with rollouts and steps")
        parser.add_argument("--seed", type=int, default=1)
        parser.add_argument("--keep", action="store_true", help="keep the seeded tasks")
        parser.add_argument("--out", default=str(Path(settings.BASE_DIR) / "artifacts" / "bench" / "growth.json"))

    def handle(self, *args, **options):
        sizes = [int(n) for n in options["sizes"].split(",")]
        if sizes != sorted(sizes):
            raise CommandError("--sizes must grow")
        started = time.monotonic()
        growth = GraphGrowth(
            prefix=f"growth-{options['tasks_mode']}",
            tasks_mode=options["tasks_mode"],
            nodes_per_task=options["nodes_per_task"],
            snapshot_share=options["snapshot_share"],
            max_snapshots=options["max_snapshots"],
            rollout_share=options["rollout_share"],
            seed=options["seed"],
        )
        growth.drop_existing()
        budget = Budget(
            options["requests"],
            options["page_requests"],
            options["heavy_requests"],
            options["warmup"],
            options["op_seconds"],
        )
        name = f"bench-growth-{uuid.uuid4().hex[:8]}"
        user = get_user_model().objects.create_user(name, is_staff=True, is_superuser=True)
        client = Client()
        client.force_login(user)
        cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"
        token = token_create(name=name)
        report = {"command": "manage.py bench_growth", "options": options, "machine": _machine(), "rows": []}
        out = Path(options["out"])
        try:
            for size in sizes:
                if time.monotonic() - started > options["budget_minutes"] * 60:
                    report["stopped"] = f"budget of {options['budget_minutes']} minutes spent before {size} nodes"
                    self.stdout.write(report["stopped"])
                    break
                row = self._size(growth, size, budget, token, cookie, options["workers"])
                report["rows"].append(row)
                report["over_1_5x"] = ratios(report["rows"])
                _write(out, report)
                self.stdout.write(
                    f"{row['nodes']:>10,} nodes, {row['totals']['snapshots']:,} snapshots, "
                    f"{row['totals']['tasks']:,} tasks: seeded in {row['seed']['seed_s']} s "
                    f"(+{row['seed']['vacuum_s']} s vacuum), {row['storage']['per_node']['total']} bytes/node"
                )
        finally:
            if not options["keep"]:
                growth.drop_existing()
            ApiToken.objects.filter(name=name).delete()
            user.delete()
        self.stdout.write(table(report["rows"]))
        self.stdout.write(f"wrote {out}")

    def _size(self, growth: GraphGrowth, size: int, budget: Budget, token: str, cookie: str, workers: int) -> dict:
        seeded = growth.grow_to(size)
        sample = next((s for s in growth.deep.items if s.task_id == growth.measured_task), None)
        with service_running(workers=workers, db=connection.settings_dict) as service:
            with (
                httpx.Client(base_url=service.url, headers={"Authorization": f"Token {token}"}, timeout=300) as api,
                httpx.Client(base_url=service.url, headers={"Cookie": cookie}, timeout=300) as pages,
            ):
                operations = measure_size(growth=growth, api=api, pages=pages, budget=budget, size=size)
        return {
            "nodes": growth.totals["nodes"],
            "totals": dict(growth.totals),
            "measured_task": growth.measured_task,
            "seed": seeded,
            "operations": operations,
            "storage": storage(),
            "plans": plans(task_id=growth.measured_task, sample=sample),
            "load_average": [round(x, 2) for x in os.getloadavg()],
        }


def _machine() -> dict:
    with connection.cursor() as cursor:
        cursor.execute("SHOW shared_buffers")
        shared_buffers = cursor.fetchone()[0]
        cursor.execute("SELECT version()")
        postgres = cursor.fetchone()[0]
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "postgres": postgres,
        "shared_buffers": shared_buffers,
    }


def _write(out: Path, report: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
