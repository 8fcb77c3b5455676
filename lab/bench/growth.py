"""The growth benchmark (`manage.py bench_growth`): whether the hot paths, the reads and the
dashboard stay flat as the graph grows from 10,000 to millions of nodes (docs/operations/growth.md).

`GraphGrowth` seeds tasks through the database in bulk (COPY, not the API) with rows as the
service writes them: every node's anchor, digest and state key come from the real key chain
(`cache.tcg.state_chain` and `record_plan`, as lookup.py and record.py compute them), so a lookup
of a seeded path hits the seeded node. It keeps a sample of seeded paths to look up.
`measure_size` times each operation against the service as deployed, sequentially, after a
warm-up; `storage` and `plans` say what a node costs on disk and how the growing queries run.
"""

from __future__ import annotations

import io
import itertools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
from django.db import connection

from cache.models import Task, ToolStat
from cache.services import task_flush, task_put
from cache.services.lookup import task_chain
from cache.services.tasks import task_handle
from cache.services.totals import task_totals_count
from cache.tcg import StateChain, ToolCall, canonical_call, record_plan, result_json
from cache.tcg.records import CallContext
from lab.figures import percentile

ENV = {"backend": "directory", "files": {"README": "growth"}}
TOOLS = {"write_file": {"mutates_state": True}, "read_file": {"mutates_state": False}}
EPOCHS = 10
SHALLOW = 4  # a "shallow" hit has at most this many calls before it
DEEP = 14  # a "deep" one at least this many
CHUNK_NODES = 50_000  # rows generated and copied per round trip
AT = "2026-11-27 00:00:00+00"

# The columns bulk seeding writes (COPY), also for bench_tree_export.
NODE_COLUMNS = (
    "id, task_id, anchor_key, call_digest, state_key, parent_id, depth, tool, call, mutates, result_json, "
    "result_bytes, exec_ms, cum_exec_ms, hit_count, first_rollout_id, first_epoch, pinned, created_at, "
    "state_fingerprint, state_shape, state_order, live_processes, divergent"
)
ROLLOUT_COLUMNS = (
    "id, task_id, rollout_id, epoch, calls, hits, history_length, started_at, detached_reason, branch_of, branch_step, "
    "branch_node, trajectory_ref, branch_tokens"
)
STEP_COLUMNS = "rollout_id, applied, seq, at, node_id, hit, tokens"
SNAPSHOT_COLUMNS = (
    "task_id, node_id, backend, engine, ref, owner, status, size_bytes, create_ms, keeps_processes, exact, created_at"
)


def copy_digest(key: str) -> str:
    r"""A node key (64 hex characters) as a bytea in COPY's text format: \\x and the hex (COPY
    reads the escaped backslash as one, then bytea's hex input)."""
    return "\\\\x" + key


# Text a seeded call writes or a read returns: letters and spaces only, nothing COPY escapes.
TEXT = "".join(random.Random(0).choice("abcdefghijklmnopqrstuvwxyz     ") for _ in range(8192))


@dataclass(frozen=True, slots=True)
class SeededCall:
    """A seeded node and the history that leads to it: what a lookup sends to hit it."""

    task_id: str
    history: tuple[ToolCall, ...]
    call: ToolCall
    node_id: int


@dataclass
class Reservoir:
    """A uniform sample of everything offered so far (Vitter's algorithm R)."""

    size: int
    rng: random.Random
    items: list = field(default_factory=list)
    seen: int = 0

    def offer(self, item) -> None:
        self.seen += 1
        if len(self.items) < self.size:
            self.items.append(item)
        else:
            slot = self.rng.randrange(self.seen)
            if slot < self.size:
                self.items[slot] = item


@dataclass
class _Ids:
    node: int
    rollout: int


class GraphGrowth:
    """The seeded graph, grown in steps: one task (`tasks_mode="one"`) or tasks of
    `nodes_per_task` nodes each (`"many"`, the measured task is the first one). Each group of
    rollouts is a root rollout `depth` calls deep and `branches` branches from it at random steps;
    about one call in four reads (read_file), the others write (write_file)."""

    def __init__(
        self,
        *,
        prefix: str,
        tasks_mode: str = "one",
        nodes_per_task: int = 1000,
        depth: int = 20,
        branches: int = 7,
        snapshot_share: float = 0.1,
        max_snapshots: int = 100_000,
        rollout_share: float = 0.25,
        sample: int = 4000,
        seed: int = 1,
    ):
        self.prefix, self.tasks_mode, self.nodes_per_task = prefix, tasks_mode, nodes_per_task
        self.depth, self.branches = depth, branches
        self.snapshot_share, self.max_snapshots, self.rollout_share = snapshot_share, max_snapshots, rollout_share
        self.rng = random.Random(seed)
        self.shallow = Reservoir(sample, random.Random(seed + 1))
        self.deep = Reservoir(sample, random.Random(seed + 2))
        self.group_roots = Reservoir(sample, random.Random(seed + 3))  # (task, id of a group's first node)
        self.totals = {"nodes": 0, "snapshots": 0, "rollouts": 0, "steps": 0, "tasks": 0, "groups": 0}
        self.tasks: list[str] = []
        self._task_nodes: dict[str, int] = {}
        self._handle = None  # the current task's TaskHandle: its fingerprint and policy key the chain

    @property
    def measured_task(self) -> str:
        return self.tasks[0]

    def drop_existing(self) -> None:
        """Remove the tasks an earlier run under the same prefix left."""
        for task_id in Task.objects.filter(pk__startswith=self.prefix).values_list("pk", flat=True):
            task_flush(task_id=task_id)
            Task.objects.filter(pk=task_id).delete()

    def grow_to(self, nodes: int) -> dict:
        """Add rows until the graph holds `nodes` nodes; returns the seconds it took by phase."""
        started = time.perf_counter()
        ids = self._next_ids()
        while self.totals["nodes"] < nodes:
            buffers = {name: io.StringIO() for name in ("cache_node", "cache_rollout", "cache_rolloutstep", "snap")}
            chunk_end = min(nodes, self.totals["nodes"] + CHUNK_NODES)
            first = ids.node
            while self.totals["nodes"] < chunk_end:
                task_id = self._task_for_next_group()
                self._group(task_id, ids, buffers)
            self._copy(buffers)
            task_totals_count(first_id=first, last_id=ids.node - 1)  # as records would have counted them
        copied = time.perf_counter()
        self._sequences_reset()
        with connection.cursor() as cursor:
            for table in ("cache_node", "cache_snapshot", "cache_rollout", "cache_rolloutstep", "cache_task"):
                cursor.execute(f"VACUUM (ANALYZE) {table}")
        return {"seed_s": round(copied - started, 1), "vacuum_s": round(time.perf_counter() - copied, 1)}

    # --- tasks -----------------------------------------------------------------------------------

    def _task_for_next_group(self) -> str:
        if not self.tasks or (self.tasks_mode == "many" and self._task_nodes[self.tasks[-1]] >= self.nodes_per_task):
            self._task_add()
        return self.tasks[-1]

    def _task_add(self) -> None:
        task_id = f"{self.prefix}-{len(self.tasks)}"
        task_put(task_id=task_id, env=ENV, tools=TOOLS, sandbox_budget=self.max_snapshots, audit_rate=0.0)
        ToolStat.objects.bulk_create(
            ToolStat(
                task_id=task_id,
                epoch=epoch,
                tool=tool,
                calls=1000,
                hits=300 + 40 * epoch,
                oracle_hits=400 + 40 * epoch,
                executions=600,
                executed_ms=60_000.0,
                saved_ms=30_000.0,
            )
            for epoch in range(EPOCHS)
            for tool in TOOLS
        )
        self._handle = task_handle(task_id=task_id)
        self.tasks.append(task_id)
        self._task_nodes[task_id] = 0
        self.totals["tasks"] += 1

    # --- rows --------------------------------------------------------------------------------------

    def _group(self, task_id: str, ids: _Ids, buffers: dict[str, io.StringIO]) -> None:
        """One root rollout and its branches, as the service would have recorded them."""
        group = self.totals["groups"]
        self.totals["groups"] += 1
        with_rollouts = self.rng.random() < self.rollout_share
        root_calls: list[ToolCall] = []
        root_ids: list[int] = []
        root_cums: list[float] = []
        for branch in range(self.branches + 1):
            step = 0 if branch == 0 else self.rng.randint(1, self.depth - 1)
            calls = root_calls[:step] + [self._call(group, branch, d) for d in range(step, self.depth)]
            chain = task_chain(self._handle, _context(tuple(calls[:-1]), calls[-1]))
            path, cums = root_ids[:step], root_cums[:step]
            for position in range(step, self.depth):
                self._node(task_id, ids, chain, position, path, cums, f"g{group}.r{branch}", buffers)
            if branch == 0:
                root_calls, root_ids, root_cums = calls, path, cums
                self.group_roots.offer((task_id, path[0]))
            if with_rollouts:
                self._rollout(task_id, ids, group, branch, step, path, root_ids, buffers)

    def _call(self, group: int, branch: int, d: int) -> ToolCall:
        offset = self.rng.randrange(len(TEXT) - 400)
        if d % 4 == 3:
            return ToolCall("read_file", {"path": f"src/g{group}/r{branch}/f{d}.py"})
        return ToolCall(
            "write_file",
            {"path": f"src/g{group}/r{branch}/f{d}.py", "content": TEXT[offset : offset + self.rng.randint(50, 400)]},
        )

    def _node(self, task_id, ids, chain: StateChain, position: int, path, cums, rollout, buffers) -> None:
        """The node at `position` of `chain`, appended to `path` (node ids) and `cums` (their
        cum_exec_ms); its parent is the path's last state-changing node (record.py)."""
        prefix = StateChain(chain.root, chain.steps[: position + 1])
        plan = record_plan(prefix, self._handle.policy, None)
        step = prefix.steps[-1]
        parent_position = next((p.position for p in reversed(prefix.steps[:-1]) if p.mutates), None)
        parent = None if parent_position is None else path[parent_position]
        parent_cum = 0.0 if parent_position is None else cums[parent_position]
        if step.call.tool == "read_file":
            offset = self.rng.randrange(len(TEXT) - 1000)
            result = {"output": TEXT[offset : offset + self.rng.randint(100, 1000)], "ok": True}
        else:
            result = {"output": "", "ok": True}
        stored = result_json(result).decode()
        exec_ms = round(self.rng.uniform(5, 500), 1)
        cum = parent_cum + (exec_ms if plan.mutates else 0.0)  # as record.py sums it
        node_id = ids.node
        ids.node += 1
        buffers["cache_node"].write(
            "\t".join(
                (
                    str(node_id),
                    task_id,
                    copy_digest(plan.anchor),
                    copy_digest(plan.digest),
                    copy_digest(plan.state_key),
                    "\\N" if parent is None else str(parent),
                    str(plan.depth),
                    step.call.tool,
                    canonical_call(step.call).decode(),
                    "t" if plan.mutates else "f",
                    stored,
                    str(len(stored)),
                    str(exec_ms),
                    str(cum),
                    "0",
                    rollout,
                    "0",
                    "f",
                    AT,
                    "",
                    "",
                    "",
                    "0",
                    "f",
                )
            )
            + "\n"
        )
        self.totals["nodes"] += 1
        self._task_nodes[task_id] += 1
        seeded = SeededCall(task_id, tuple(s.call for s in prefix.steps[:-1]), step.call, node_id)
        if position <= SHALLOW:
            self.shallow.offer(seeded)
        if position >= DEEP:
            self.deep.offer(seeded)
        if plan.mutates and self.totals["snapshots"] < self.max_snapshots and self.rng.random() < self.snapshot_share:
            self.totals["snapshots"] += 1
            buffers["snap"].write(
                f"{task_id}\t{node_id}\tdirectory\t\tgrowth-{node_id}\tservice\tlive\t"
                f"{self.rng.randrange(1, 500) * 1024 * 1024}\t{self.rng.uniform(50, 900):.1f}\tf\tt\t{AT}\n"
            )
        path.append(node_id)
        cums.append(cum)

    def _rollout(self, task_id, ids, group, branch, step, path, root_ids, buffers) -> None:
        rollout_id = f"g{group}.r{branch}"
        origin = ("", "\\N", "\\N") if branch == 0 else (f"g{group}.r0", str(step), str(root_ids[step - 1]))
        tokens = "\\N" if branch == 0 else f'{{"prompt": [0, {100 * step}]}}'
        fields = (str(ids.rollout), task_id, rollout_id, str(group % EPOCHS), str(len(path)), str(step), "0", AT, "")
        buffers["cache_rollout"].write("\t".join((*fields, *origin, f"traj/{rollout_id}", tokens)) + "\n")
        at = time.time_ns()
        for i, node_id in enumerate(path):
            span = f'{{"prompt": [0, {100 * i + 60}], "completion": [{100 * i + 60}, {100 * (i + 1)}]}}'
            buffers["cache_rolloutstep"].write(
                f"{ids.rollout}\t{i}\t{i}\t{at + i}\t{node_id}\t{'t' if i < step else 'f'}\t{span}\n"
            )
        self.totals["rollouts"] += 1
        self.totals["steps"] += len(path)
        ids.rollout += 1

    # --- the database ------------------------------------------------------------------------------

    def _next_ids(self) -> _Ids:
        with connection.cursor() as cursor:
            cursor.execute("SELECT coalesce(max(id), 0) + 1 FROM cache_node")
            node = cursor.fetchone()[0]
            cursor.execute("SELECT coalesce(max(id), 0) + 1 FROM cache_rollout")
            return _Ids(node=node, rollout=cursor.fetchone()[0])

    def _copy(self, buffers: dict[str, io.StringIO]) -> None:
        connection.ensure_connection()
        raw = connection.connection
        with raw.cursor() as cursor:
            for table, columns, name in (
                ("cache_node", NODE_COLUMNS, "cache_node"),
                ("cache_snapshot", SNAPSHOT_COLUMNS, "snap"),
                ("cache_rollout", ROLLOUT_COLUMNS, "cache_rollout"),
                ("cache_rolloutstep", STEP_COLUMNS, "cache_rolloutstep"),
            ):
                text = buffers[name].getvalue()
                if text:
                    with cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
                        copy.write(text)
        if not connection.get_autocommit():
            raw.commit()

    def _sequences_reset(self) -> None:
        with connection.cursor() as cursor:
            for table in ("cache_node", "cache_rollout", "cache_snapshot"):
                cursor.execute(
                    f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT coalesce(max(id), 1) FROM {table}))"
                )


def _context(history: tuple[ToolCall, ...], call: ToolCall) -> CallContext:
    return CallContext(history, call, "growth", 0, None)


# --- measuring ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Budget:
    requests: int  # timed requests per hot-path operation (lookup, record, tool-server call)
    page_requests: int  # per read (stats, graph, tree, pages)
    heavy_requests: int  # per whole-graph export
    warmup: int
    op_seconds: float  # an operation stops early after this long


def timed(send: Callable[[int], bool], count: int, warmup: int, seconds: float) -> dict:
    """`send(i)` returns whether the answer was the expected one; `count` timed after `warmup`
    untimed calls, stopping after `seconds`. Milliseconds to the full response."""
    for i in range(warmup):
        send(-1 - i)
    samples, wrong = [], 0
    deadline = time.monotonic() + seconds
    for i in range(count):
        started = time.perf_counter()
        ok = send(i)
        samples.append((time.perf_counter() - started) * 1000)
        wrong += not ok
        if time.monotonic() > deadline:
            break
    return {
        "n": len(samples),
        "p50_ms": percentile(samples, 50, 2),
        "p99_ms": percentile(samples, 99, 2),
        "max_ms": round(max(samples), 2) if samples else None,
        "wrong": wrong,
    }


def _body(history, call, **extra) -> dict:
    return {"history": [c.to_json() for c in history], "call": call.to_json(), "rollout_id": "growth", **extra}


def measure_size(
    *, growth: GraphGrowth, api: httpx.Client, pages: httpx.Client, budget: Budget, size: int
) -> dict[str, dict]:
    """Every operation once against the running service; keys are the operations' names."""
    rng = random.Random(size)
    deep = list(growth.deep.items)
    rng.shuffle(deep)
    draw = iter(deep)  # each deep sample used once per size: no answer comes from the hit cache
    shallow = list(growth.shallow.items)
    rng.shuffle(shallow)
    task = growth.measured_task
    hot = (budget.requests, budget.warmup, budget.op_seconds)
    reads = (budget.page_requests, min(budget.warmup, 3), budget.op_seconds)
    out = {}

    def lookup(sample: SeededCall, call: ToolCall | None = None) -> dict:
        body = _body(sample.history, call or sample.call, epoch=0)
        response = api.post(f"/api/v1/tasks/{sample.task_id}/lookup", json=body)
        response.raise_for_status()
        return response.json()

    def hit(samples: Iterator[SeededCall]) -> Callable[[int], bool]:
        def send(_: int) -> bool:
            sample = next(samples)
            answer = lookup(sample)
            return answer["hit"] and answer["node_id"] == sample.node_id

        return send

    out["lookup hit (shallow)"] = timed(hit(itertools.cycle(shallow)), *hot)
    out["lookup hit (deep)"] = timed(hit(draw), *hot)

    def miss(i: int) -> bool:
        sample = next(draw)
        answer = lookup(sample, ToolCall("write_file", {"path": f"miss/{size}/{i}", "content": "never recorded"}))
        return not answer["hit"]

    out["lookup miss"] = timed(miss, *hot)

    def record(i: int) -> bool:
        sample = next(draw)
        call = ToolCall("write_file", {"path": f"new/{size}/{i}", "content": "recorded by the bench"})
        body = _body((*sample.history, sample.call), call, result={"output": "", "ok": True}, exec_ms=12.5)
        response = api.post(f"/api/v1/tasks/{sample.task_id}/record", json=body)
        response.raise_for_status()
        return response.json()["created"]

    out["record"] = timed(record, *hot)
    out["tool-server hit"] = timed(_tool_server_calls(api, draw, size), *hot)
    roots = [node for task_id, node in growth.group_roots.items if task_id == task]
    subtree = itertools.cycle(roots)
    for name, path in (
        ("stats", lambda i: f"/api/v1/tasks/{task}/stats"),
        ("graph (a group's subtree)", lambda i: f"/api/v1/tasks/{task}/graph?root={next(subtree)}"),
        ("tree export (100 rollouts)", lambda i: f"/api/v1/tasks/{task}/tree?limit=100"),
    ):
        out[name] = timed(_get(api, path), *reads)
    out["graph (whole, as exported)"] = timed(
        _get(api, lambda i: f"/api/v1/tasks/{task}/graph"), budget.heavy_requests, 1, budget.op_seconds
    )
    # A page of the paged export from the middle of the graph (the seeded paths are 20 calls deep).
    out["graph (a page of 1,000 nodes from depth 10)"] = timed(
        _get(api, lambda i: f"/api/v1/tasks/{task}/graph?limit=1000&after=10.0"), *reads
    )
    node = next((s.node_id for s in deep if s.task_id == task), None)
    for name, path in (
        ("page: overview", "/"),
        ("page: task", f"/tasks/{task}/"),
        ("page: graph", f"/tasks/{task}/graph/"),
        ("page: pools", "/pools/"),
        ("page: tree", f"/tasks/{task}/tree/"),
        ("page: node (deep)", f"/tasks/{task}/nodes/{node}/"),
    ):
        out[name] = timed(_get(pages, lambda i, path=path: path), *reads)
    return out


def _get(client: httpx.Client, path: Callable[[int], str]) -> Callable[[int], bool]:
    def send(i: int) -> bool:
        with client.stream("GET", path(i)) as response:
            for _ in response.iter_bytes():
                pass
            return response.status_code == 200

    return send


def _tool_server_calls(api: httpx.Client, draw: Iterator[SeededCall], size: int) -> Callable[[int], bool]:
    """Fresh rollouts walking seeded paths call by call (POST .../rollouts/{id}/calls): every call
    a hit, served without a sandbox."""
    state = {"calls": iter(()), "task": "", "rollout": ""}
    walks = itertools.count()

    def send(i: int) -> bool:
        call = next(state["calls"], None)
        if call is None:
            sample = next(draw)
            state.update(
                calls=iter((*sample.history, sample.call)), task=sample.task_id, rollout=f"ts-{size}-{next(walks)}"
            )
            call = next(state["calls"])
        response = api.post(
            f"/api/v1/tasks/{state['task']}/rollouts/{state['rollout']}/calls", json={"call": call.to_json()}
        )
        response.raise_for_status()
        return response.json()["cached"]

    return send


# --- what a node costs, how the growing queries run ---------------------------------------------------


def storage() -> dict:
    """cache_node's bytes (heap, TOAST, each index) and per row, and the average stored size of
    each column (over a sample of the rows when there are many)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM cache_node")
        rows = cursor.fetchone()[0]
        cursor.execute(
            "SELECT pg_total_relation_size('cache_node'), pg_relation_size('cache_node'),"
            " pg_indexes_size('cache_node'), coalesce(pg_total_relation_size(reltoastrelid), 0)"
            " FROM pg_class WHERE relname = 'cache_node'"
        )
        total, heap, indexes, toast = cursor.fetchone()
        cursor.execute(
            "SELECT i.relname, pg_relation_size(i.oid) FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid"
            " WHERE x.indrelid = 'cache_node'::regclass ORDER BY 2 DESC"
        )
        index_bytes = dict(cursor.fetchall())
        cursor.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'cache_node'::regclass AND attnum > 0"
            " AND NOT attisdropped ORDER BY attnum"
        )
        columns = [row[0] for row in cursor.fetchall()]
        sample = " TABLESAMPLE SYSTEM (2) REPEATABLE (1)" if rows > 500_000 else ""
        averages = ", ".join(f'avg(pg_column_size("{c}"))' for c in columns)
        cursor.execute(f"SELECT {averages} FROM cache_node{sample}")
        sizes = {c: round(float(v or 0), 1) for c, v in zip(columns, cursor.fetchone())}
        cursor.execute("SELECT pg_total_relation_size('cache_snapshot'), count(*) FROM cache_snapshot")
        snapshot_bytes, snapshots = cursor.fetchone()
        cursor.execute("SELECT pg_total_relation_size('cache_rolloutstep'), count(*) FROM cache_rolloutstep")
        step_bytes, steps = cursor.fetchone()
    per = (lambda b: round(b / rows, 1)) if rows else (lambda b: None)
    return {
        "rows": rows,
        "total_bytes": total,
        "heap_bytes": heap,
        "toast_bytes": toast,
        "index_bytes": indexes,
        "per_node": {"total": per(total), "heap": per(heap), "toast": per(toast), "indexes": per(indexes)},
        "per_node_by_index": {name: per(b) for name, b in index_bytes.items()},
        "column_avg_bytes": dict(sorted(sizes.items(), key=lambda kv: -kv[1])),
        "snapshots": {"rows": snapshots, "total_bytes": snapshot_bytes},
        "rollout_steps": {"rows": steps, "total_bytes": step_bytes},
    }


# The statements behind the reads that once scanned a task's nodes or snapshots, as the selectors
# send them now (the table of docs/operations/growth.md says what each replaced).
PLANS = {
    "task totals (stats, task page, overview, graph page)": (
        "SELECT tool, nodes, roots, result_bytes, process_states, divergent, exec_ms_buckets"
        " FROM cache_tasktotal WHERE task_id = %(task)s ORDER BY tool"
    ),
    "graph page: first levels": (
        "SELECT n.id, (SELECT s.id FROM cache_snapshot s WHERE s.node_id = n.id AND s.status = 'live' LIMIT 1)"
        " FROM cache_node n WHERE n.task_id = %(task)s AND n.depth <= 3 ORDER BY n.depth, n.id LIMIT 150"
    ),
    "pools page: a task's newest live snapshots": (
        "SELECT id FROM cache_snapshot WHERE task_id = %(task)s AND status = 'live'"
        " ORDER BY created_at DESC, id DESC LIMIT 50"
    ),
    "pools page: whether a task holds live snapshots": (
        "SELECT EXISTS (SELECT 1 FROM cache_snapshot WHERE task_id = %(task)s AND status = 'live')"
    ),
    "tree page: epochs": (
        "SELECT epoch, count(id), sum(calls) FROM cache_rollout WHERE task_id = %(task)s GROUP BY epoch ORDER BY 1 DESC"
    ),
    "lookup: node by key": (
        "SELECT id, result_json FROM cache_node WHERE task_id = %(task)s AND anchor_key = decode(%(anchor)s, 'hex')"
        " AND call_digest = decode(%(digest)s, 'hex')"
    ),
}


def plans(*, task_id: str, sample: SeededCall | None) -> dict[str, dict]:
    """EXPLAIN (ANALYZE, BUFFERS) of each statement in PLANS on the measured task: its time and plan."""
    params = {"task": task_id, "anchor": "", "digest": ""}
    if sample is not None:
        last = task_chain(task_handle(task_id=sample.task_id), _context(sample.history, sample.call)).steps[-1]
        params.update(task=sample.task_id, anchor=last.anchor, digest=last.digest)
    out = {}
    with connection.cursor() as cursor:
        for name, sql in PLANS.items():
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params)
            lines = [row[0] for row in cursor.fetchall()]
            took = next((float(line.split()[2]) for line in lines if line.startswith("Execution Time")), None)
            out[name] = {"ms": took, "plan": lines}
    return out


# --- the report ---------------------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    """Operation x size: p50 / p99 (ms) and their ratios to the first size's."""
    sizes = [row["nodes"] for row in rows]
    operations = list(rows[0]["operations"]) if rows else []
    head = "| operation | " + " | ".join(f"{n:,} nodes" for n in sizes) + " |"
    lines = [head, "|---|" + "---:|" * len(sizes)]
    for op in operations:
        base = rows[0]["operations"][op]
        cells = []
        for row in rows:
            figure = row["operations"].get(op) or {}
            cells.append(_cell(figure, base))
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(figure: dict, base: dict) -> str:
    if figure.get("p50_ms") is None:
        return "-"
    text = f"{figure['p50_ms']:.1f} / {figure['p99_ms']:.1f}"
    if figure is not base and base.get("p50_ms"):
        text += f" ({figure['p50_ms'] / base['p50_ms']:.1f}x / {figure['p99_ms'] / base['p99_ms']:.1f}x)"
    return text


def ratios(rows: list[dict], limit: float = 1.5) -> list[dict]:
    """The operations whose p50 or p99 at some size exceeds `limit` times the first size's."""
    out = []
    for op, base in (rows[0]["operations"] if rows else {}).items():
        for row in rows[1:]:
            figure = row["operations"].get(op) or {}
            if not base.get("p50_ms") or figure.get("p50_ms") is None:
                continue
            p50, p99 = figure["p50_ms"] / base["p50_ms"], figure["p99_ms"] / base["p99_ms"]
            if p50 > limit or p99 > limit:
                out.append(
                    {"operation": op, "nodes": row["nodes"], "p50_ratio": round(p50, 2), "p99_ratio": round(p99, 2)}
                )
    return out
