"""Benchmark of the dashboard on a 10,000-node task: server time per page (Django test client,
median of several renders) and time to the first graph paint in Chromium (the performance mark
graph.js sets once Cytoscape has drawn). Writes artifacts/bench/dashboard.json and prints a table.

    python manage.py bench_dashboard [--nodes 10000] [--runs 9] [--paints 5] [--keep]

It writes a task named `bench-dashboard` (and a temporary staff user) into the configured database
and removes both at the end unless --keep is given."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import connection, transaction
from django.db.models import Max
from django.test import Client
from django.test.utils import CaptureQueriesContext

from cache.models import AuditEntry, Node, Rollout, Snapshot, Task, ToolStat
from cache.services import task_put
from lab import browser
from lab.server import service_running

SHOTS = Path(settings.BASE_DIR) / "artifacts" / "screenshots"
TASK_ID = "bench-dashboard"
USER = "bench-dashboard"
PAGE_TARGET_MS = 300.0
PAINT_TARGET_MS = 1000.0
TOOLS = {"bash": True, "apply_patch": True, "read_file": False}


def _digest(*parts) -> str:
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()


def build_task(n_nodes: int, seed: int = 0) -> dict:
    """A tree shaped like GRPO rollouts of one task: a few first calls, then branching paths of
    builds, patches and test runs, each state with a read-only call or two hanging off it."""
    rng = random.Random(seed)
    Task.objects.filter(pk=TASK_ID).delete()
    task_put(
        task_id=TASK_ID,
        env={"backend": "external", "bench": "dashboard"},
        tools={name: {"mutates_state": mutates} for name, mutates in TOOLS.items()},
        sandbox_budget=64,
    )
    task = Task.objects.get(pk=TASK_ID)
    created = 0
    level: list[Node | None] = [None]
    depth = 1
    while created < n_nodes and level:
        batch = []
        for parent in level:
            # Wide at the top (the first paint draws as many nodes as it may), then narrower.
            fanout = 10 if parent is None else rng.choice((3, 4, 5, 6) if depth <= 3 else (1, 1, 2, 2, 3))
            for i in range(fanout):
                mutates = rng.random() > 0.3
                tool = rng.choice(("bash", "apply_patch")) if mutates else "read_file"
                if tool == "bash":
                    args = {
                        "command": rng.choice(
                            (
                                "make -j2",
                                "pytest -q",
                                "pip install -e .",
                                "git apply fix.diff",
                                "python run.py --seed %d" % rng.randrange(100),
                                "ls -la src",
                            )
                        )
                    }
                elif tool == "apply_patch":
                    args = {
                        "patch": "--- a/src/mod%d.py\n+++ b/src/mod%d.py\n@@ -1 +1 @@\n-x = 1\n+x = %d\n"
                        % (i, i, rng.randrange(1000))
                    }
                else:
                    args = {"path": "src/mod%d.py" % rng.randrange(50)}
                anchor = parent.state_key if parent is not None else _digest("root", TASK_ID)
                digest = _digest(tool, args, depth, len(batch), created)
                exec_ms = rng.lognormvariate(6.0, 1.5) if tool != "read_file" else rng.uniform(2, 20)
                result = json.dumps(
                    {"stdout": "ok\n" * rng.randrange(1, 40), "stderr": "", "exit_code": 0, "timed_out": False}
                )
                batch.append(
                    Node(
                        task=task,
                        anchor_key=anchor,
                        call_digest=digest,
                        state_key=_digest(anchor, digest) if mutates else anchor,
                        parent=parent,
                        depth=depth if mutates or parent is None else parent.depth + 1,
                        tool=tool,
                        call={"tool": tool, "args": args},
                        mutates=mutates,
                        result_json=result,
                        result_bytes=len(result),
                        exec_ms=exec_ms,
                        cum_exec_ms=(parent.cum_exec_ms if parent else 0.0) + (exec_ms if mutates else 0.0),
                        hit_count=int(rng.expovariate(1 / 20)) if rng.random() < 0.6 else 0,
                        first_rollout_id=f"r{rng.randrange(16)}",
                        first_epoch=rng.randrange(10),
                    )
                )
                if created + len(batch) >= n_nodes:
                    break
            if created + len(batch) >= n_nodes:
                break
        nodes = Node.objects.bulk_create(batch, batch_size=2000)
        created += len(nodes)
        level = [node for node in nodes if node.mutates]
        depth += 1
    writes = list(Node.objects.filter(task=task, mutates=True).values_list("pk", flat=True))
    Snapshot.objects.bulk_create(
        [
            Snapshot(
                task=task,
                node_id=node_id,
                backend="docker",
                ref=f"tvcache-bench:{node_id}",
                owner="service",
                size_bytes=rng.randrange(50, 900) * 1024 * 1024,
                create_ms=rng.uniform(200, 900),
            )
            for node_id in rng.sample(writes, min(64, len(writes)))
        ]
    )
    ToolStat.objects.bulk_create(
        [
            ToolStat(
                task=task,
                epoch=epoch,
                tool=tool,
                calls=calls,
                hits=int(calls * (0.2 + 0.06 * epoch)),
                oracle_hits=int(calls * (0.3 + 0.06 * epoch)),
                executions=calls // 2,
                executed_ms=calls * 900.0,
                saved_ms=calls * 400.0 * (0.2 + 0.06 * epoch),
            )
            for epoch in range(10)
            for tool, calls in (("bash", 4000), ("apply_patch", 600), ("read_file", 2500))
        ]
    )
    Rollout.objects.bulk_create(
        [
            Rollout(task=task, rollout_id=f"e{epoch}-r{r}", epoch=epoch, calls=40, hits=rng.randrange(5, 35))
            for epoch in range(10)
            for r in range(16)
        ]
    )
    return {
        "nodes": created,
        "depth": Node.objects.filter(task=task).aggregate(d=Max("depth"))["d"],
        "top_level": Node.objects.filter(task=task, parent__isnull=True).count(),
    }


def time_pages(client: Client, urls: dict[str, str], runs: int) -> dict:
    out = {}
    for name, url in urls.items():
        assert client.get(url).status_code == 200, url  # warm-up (and a check)
        samples = []
        for _ in range(runs):
            with CaptureQueriesContext(connection) as queries:
                start = time.perf_counter()
                response = client.get(url)
                samples.append((time.perf_counter() - start) * 1000)
            assert response.status_code == 200, url
        out[name] = {
            "url": url,
            "median_ms": round(statistics.median(samples), 1),
            "min_ms": round(min(samples), 1),
            "max_ms": round(max(samples), 1),
            "queries": len(queries),
            "bytes": len(response.content),
        }
    return out


def time_first_paint(session_key: str, graph_url: str, expand_id: int, paints: int) -> dict:
    from playwright.sync_api import sync_playwright

    browser.collect_static()
    paints_ms, warm_ms, expands_ms, shown = [], [], [], 0
    with service_running(db=connection.settings_dict, workers=1, ready_path="/login/") as service:
        base = service.url
        with sync_playwright() as playwright:
            chromium = browser.chromium(playwright)
            for _ in range(paints):
                context = chromium.new_context(viewport={"width": 1400, "height": 900})  # cold cache every time
                context.add_cookies([{"name": settings.SESSION_COOKIE_NAME, "value": session_key, "url": base}])
                page = context.new_page()
                page.goto(base + graph_url)
                page.wait_for_function("window.tvGraphFirstPaint !== undefined", timeout=30_000)
                paints_ms.append(page.evaluate("window.tvGraphFirstPaint"))
                page.reload()  # a second visit: scripts come from the browser's cache, compiled
                page.wait_for_function("window.tvGraphFirstPaint !== undefined", timeout=30_000)
                warm_ms.append(page.evaluate("window.tvGraphFirstPaint"))
                shown = page.evaluate("tvGraph.cy.nodes().length")
                expands_ms.append(
                    page.evaluate(
                        "async (id) => { const t = performance.now(); await tvGraph.expand(String(id));"
                        " return performance.now() - t; }",
                        expand_id,
                    )
                )
                if len(expands_ms) == 1:
                    SHOTS.mkdir(parents=True, exist_ok=True)
                    page.wait_for_function("!tvGraph.cy.animated()")
                    page.screenshot(path=str(SHOTS / "graph-10k.png"))
                context.close()
            chromium.close()
    summary = lambda xs: {"median": round(statistics.median(xs), 1), "runs": [round(x, 1) for x in xs]}  # noqa: E731
    return {
        "first_paint_ms": summary(paints_ms),
        "first_paint_warm_ms": summary(warm_ms),
        "expand_ms": summary(expands_ms),
        "nodes_drawn": shown,
    }


class Command(BaseCommand):
    help = "Time the dashboard's pages and first graph paint on a 10,000-node task."

    def add_arguments(self, parser):
        parser.add_argument("--nodes", type=int, default=10_000)
        parser.add_argument("--runs", type=int, default=9, help="renders per page (median)")
        parser.add_argument("--paints", type=int, default=5, help="page loads in Chromium (median)")
        parser.add_argument("--keep", action="store_true", help="keep the bench task and user")
        parser.add_argument("--out", default=str(Path(settings.BASE_DIR) / "artifacts" / "bench" / "dashboard.json"))

    def handle(self, *args, nodes, runs, paints, keep, out, **options):
        started = time.perf_counter()
        with transaction.atomic():
            shape = build_task(nodes)
        build_s = time.perf_counter() - started
        self.stderr.write(f"built {shape['nodes']} nodes (depth {shape['depth']}) in {build_s:.1f} s")
        User = get_user_model()
        User.objects.filter(username=USER).delete()
        user = User.objects.create_user(USER, is_staff=True)
        audit = AuditEntry.objects.bulk_create(
            [
                AuditEntry(
                    actor_name=USER,
                    action=AuditEntry.Action.NODE_PIN,
                    task_id=TASK_ID,
                    target=f"task {TASK_ID}",
                    outcome=AuditEntry.Outcome.OK,
                    details={"bench": True},
                )
                for _ in range(200)
            ]
        )
        try:
            client = Client()
            client.force_login(user)
            deep = Node.objects.filter(task_id=TASK_ID).order_by("-depth", "pk").first()
            top = (
                Node.objects.filter(task_id=TASK_ID, depth=3, mutates=True, children__isnull=False)
                .order_by("pk")
                .first()
            )
            urls = {
                "overview": "/",
                "task": f"/tasks/{TASK_ID}/",
                "graph": f"/tasks/{TASK_ID}/graph/",
                "node (deepest)": f"/tasks/{TASK_ID}/nodes/{deep.pk}/",
                "pools": "/pools/",
                "audit": "/audit/",
                "graph JSON: expand": f"/dashboard-api/tasks/{TASK_ID}/graph?root={top.pk}&depth=3",
                "graph JSON: reveal deepest": f"/dashboard-api/tasks/{TASK_ID}/reveal/{deep.pk}",
                "graph JSON: search": f"/dashboard-api/tasks/{TASK_ID}/search?q=pytest",
            }
            pages = time_pages(client, urls, runs)
            browser_figures = time_first_paint(
                client.cookies[settings.SESSION_COOKIE_NAME].value, urls["graph"], top.pk, paints
            )
        finally:
            if not keep:
                AuditEntry.objects.filter(pk__in=[a.pk for a in audit]).delete()
                Task.objects.filter(pk=TASK_ID).delete()
                user.delete()
        report = {
            "task": {"id": TASK_ID, **shape},
            "runs": runs,
            "paints": paints,
            "pages": pages,
            **browser_figures,
            "targets": {"page_ms": PAGE_TARGET_MS, "first_paint_ms": PAINT_TARGET_MS},
            "machine": {
                "cpus": os.cpu_count(),
                "load_average": [round(x, 2) for x in os.getloadavg()],
                "python": platform.python_version(),
                "platform": platform.platform(),
            },
        }
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
        self.stdout.write(self.table(report))
        self.stdout.write(f"\nwritten to {path}")

    def table(self, report: dict) -> str:
        ok = lambda value, target: "yes" if value <= target else "NO"  # noqa: E731
        load = report["machine"]["load_average"]
        lines = [
            f"Dashboard on a {report['task']['nodes']}-node task (depth {report['task']['depth']}); "
            f"{report['machine']['cpus']} cores, load average {load[0]} / {load[1]} / {load[2]}",
            "",
            "| what | median | min | max | queries | target | met |",
            "|---|---:|---:|---:|---:|---:|:-:|",
        ]
        for name, row in report["pages"].items():
            lines.append(
                f"| {name} | {row['median_ms']} ms | {row['min_ms']} ms | {row['max_ms']} ms "
                f"| {row['queries']} "
                f"| {PAGE_TARGET_MS:.0f} ms | {ok(row['median_ms'], PAGE_TARGET_MS)} |"
            )
        for key, what in (
            ("first_paint_ms", "first graph paint, cold cache"),
            ("first_paint_warm_ms", "first graph paint, second visit"),
        ):
            paint = report[key]
            lines.append(
                f"| {what} (Chromium, {report['nodes_drawn']} nodes drawn) | {paint['median']} ms "
                f"| {min(paint['runs'])} ms | {max(paint['runs'])} ms | | {PAINT_TARGET_MS:.0f} ms "
                f"| {ok(paint['median'], PAINT_TARGET_MS)} |"
            )
        expand = report["expand_ms"]
        lines.append(
            f"| expand a node (fetch + layout, Chromium) | {expand['median']} ms | {min(expand['runs'])} ms "
            f"| {max(expand['runs'])} ms | | | |"
        )
        return "\n".join(lines)
