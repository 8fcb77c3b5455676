"""How long the rollout tree export of a large task takes, and whether the server's memory grows
with it (issue: the tree of a task with 100,000 nodes streams in under 5 s, at constant memory).

Seeds tasks in bulk through the database (COPY, not the API): groups of rollouts, each a root of
`--depth` calls and `--branches` branches from it at seeded steps, each branch with calls of its
own to the same depth, every call a step of its rollout's path with token spans. Serves them as
deployed (`manage.py serve --web-only`, one worker so that one process's memory is the measure)
and reads every page of each task's export over HTTP, streamed, several times. Reports time to
the last byte, the bytes and lines, and the worker's resident memory before and after, and its
peak, for each size. Writes artifacts/bench/tree-export.json (or --out).
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import statistics
import time
from pathlib import Path

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import connection

from accounts.services.tokens import token_create
from cache.services import task_flush, task_put
from cache.services.totals import task_totals_count
from lab.bench.growth import NODE_COLUMNS, ROLLOUT_COLUMNS, STEP_COLUMNS, copy_digest
from lab.server import process_tree, service_running

RESULT = json.dumps({"stdout": "x" * 600, "exit_code": 0})


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser):
        parser.add_argument("--nodes", default="10000,100000", help="comma-separated task sizes (nodes)")
        parser.add_argument("--depth", type=int, default=20, help="calls per root rollout")
        parser.add_argument("--branches", type=int, default=7, help="branches per root rollout")
        parser.add_argument("--repeat", type=int, default=3)
        parser.add_argument("--limit", type=int, default=10_000, help="rollouts per page")
        parser.add_argument("--seed", type=int, default=1)
        parser.add_argument("--out", default=str(Path(settings.BASE_DIR) / "artifacts" / "bench" / "tree-export.json"))

    def handle(self, *args, **options):
        sizes = [int(n) for n in options["nodes"].split(",")]
        tasks = {n: self._seed(f"bench-tree-{n}", n, options) for n in sizes}
        token = token_create(name=f"bench-tree-{time.time_ns()}")
        rows = []
        with service_running(workers=1) as service:
            worker = process_tree(service.pid)[-1]  # uvicorn's worker: the one process that answers
            with httpx.Client(base_url=service.url, headers={"Authorization": f"Token {token}"}, timeout=120) as http:
                for n in sizes:
                    task, seeded = tasks[n]
                    runs = []
                    for _ in range(options["repeat"]):
                        before = _memory_kib(worker)
                        runs.append({**_read_export(http, task, options["limit"]), "rss_before_kib": before["VmRSS"]})
                        runs[-1].update(
                            rss_after_kib=_memory_kib(worker)["VmRSS"], peak_kib=_memory_kib(worker)["VmHWM"]
                        )
                    row = {"nodes": n, **seeded, "runs": runs, "median_s": statistics.median(r["s"] for r in runs)}
                    rows.append(row)
                    self.stdout.write(
                        f"{n:>9} nodes {seeded['rollouts']:>7} rollouts {seeded['steps']:>8} calls: "
                        f"median {row['median_s']:.2f} s, {runs[-1]['bytes'] / 1e6:.1f} MB, "
                        f"worker RSS {runs[-1]['rss_after_kib'] / 1024:.0f} MiB (peak {runs[-1]['peak_kib'] / 1024:.0f})"
                    )
        for n in sizes:
            task_flush(task_id=tasks[n][0])
        out = Path(options["out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps({"command": "manage.py bench_tree_export", "options": options, "rows": rows}, indent=2)
        )
        self.stdout.write(f"wrote {out}")

    def _seed(self, task: str, nodes: int, options) -> tuple[str, dict]:
        task_put(task_id=task, env={"backend": "external", "bench": "tree"}, tools={}, sandbox_budget=0)
        task_flush(task_id=task)
        rng = random.Random(options["seed"])
        depth, fan = options["depth"], options["branches"]
        node_rows, rollout_rows, step_rows = io.StringIO(), io.StringIO(), io.StringIO()
        with connection.cursor() as cursor:
            cursor.execute("SELECT coalesce(max(id), 0) FROM cache_node")
            next_node = first_node = cursor.fetchone()[0] + 1
            cursor.execute("SELECT coalesce(max(id), 0) FROM cache_rollout")
            next_rollout = cursor.fetchone()[0] + 1
        made = {"rollouts": 0, "steps": 0, "nodes": 0}
        at = time.time_ns()
        group = 0
        while made["nodes"] < nodes:
            root_path = []  # node ids of the root's calls
            for rollout in range(fan + 1):
                step = 0 if rollout == 0 else rng.randint(1, depth - 1)
                path = root_path[:step]
                for d in range(step, depth):
                    if made["nodes"] >= nodes and rollout > 0:
                        break
                    key = hashlib.sha256(f"{task}/{group}/{rollout}/{d}".encode()).hexdigest()
                    parent = path[-1] if path else None
                    call = json.dumps({"tool": "bash", "args": {"command": f"step {d} of {group}.{rollout}"}})
                    node_rows.write(
                        "\t".join(
                            [
                                str(next_node),
                                task,
                                copy_digest(key),
                                copy_digest(key),
                                copy_digest(key),
                                "\\N" if parent is None else str(parent),
                                str(d + 1),
                                "bash",
                                call,
                                "t",
                                RESULT,
                                str(len(RESULT)),
                                "100",
                                str(100.0 * (d + 1)),
                                "0",
                                "",
                                "0",
                                "f",
                                "2026-11-27 00:00:00+00",
                                "",
                                "",
                                "",
                                "0",
                                "f",
                            ]
                        )
                        + "\n"
                    )
                    path.append(next_node)
                    next_node += 1
                    made["nodes"] += 1
                if rollout == 0:
                    root_path = path
                rid = f"g{group}.r{rollout}"
                origin = ("", "\\N", "\\N") if rollout == 0 else (f"g{group}.r0", str(step), str(root_path[step - 1]))
                tokens = "\\N" if rollout == 0 else json.dumps({"prompt": [0, 100 * step]})
                fields = [str(next_rollout), task, rid, "0", str(depth), str(step), "0", "2026-11-27 00:00:00+00", ""]
                rollout_rows.write("\t".join([*fields, *origin, f"traj/{rid}", tokens]) + "\n")
                for i, node in enumerate(path):
                    span = json.dumps({"prompt": [0, 100 * i + 60], "completion": [100 * i + 60, 100 * (i + 1)]})
                    step_rows.write(f"{next_rollout}\t{i}\t{i}\t{at + i}\t{node}\t{'t' if i < step else 'f'}\t{span}\n")
                    made["steps"] += 1
                next_rollout += 1
                made["rollouts"] += 1
            group += 1
        raw = connection.connection
        with raw.cursor() as cursor:
            for table, columns, rows in (
                ("cache_node", NODE_COLUMNS, node_rows),
                ("cache_rollout", ROLLOUT_COLUMNS, rollout_rows),
                ("cache_rolloutstep", STEP_COLUMNS, step_rows),
            ):
                with cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
                    copy.write(rows.getvalue())
            for table in ("cache_node", "cache_rollout"):
                cursor.execute(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT max(id) FROM {table}))")
            cursor.execute("ANALYZE cache_node; ANALYZE cache_rollout; ANALYZE cache_rolloutstep")
        raw.commit()
        task_totals_count(first_id=first_node, last_id=next_node - 1)  # as records would have counted them
        return task, made


def _read_export(http: httpx.Client, task: str, limit: int) -> dict:
    started, size, lines, after, pages = time.perf_counter(), 0, 0, None, 0
    while True:
        params = {"limit": limit, **({"after": after} if after else {})}
        last = b""
        with http.stream("GET", f"/api/v1/tasks/{task}/tree", params=params) as response:
            response.raise_for_status()
            for chunk in response.iter_bytes():
                size += len(chunk)
                lines += chunk.count(b"\n")
                last = (last + chunk)[-4096:]
        pages += 1
        after = json.loads(last.splitlines()[-1])["next"]
        if after is None:
            return {"s": time.perf_counter() - started, "bytes": size, "lines": lines, "pages": pages}


def _memory_kib(pid: int) -> dict[str, int]:
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            found[name] = int(value.split()[0])
    return found
