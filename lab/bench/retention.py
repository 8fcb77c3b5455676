"""The retention soak (`manage.py soak_retention`): a simulated long training run against tasks with a
retention policy, to see the database hold at the budget, lookups stay flat and nothing be lost
that was not evicted (docs/operations/retention.md).

`Workload` makes the calls of simulated rollouts and the result each call returns: a task's
rollouts share their first calls (a few popular choices, less shared the deeper they go), then
run off on their own; every `drift` steps the policy moves on and the popular calls past the
first `stable` ones change, so old subtrees go cold. A result is a function of the task, the
history of state-changing calls and the call, so every hit can be checked byte for byte.

`Soak` drives lookups and records through the services (cache.services.tcg_lookup, node_record),
its drivers side by side, each a thread with its own connection and its share of the tasks, its
rollouts one after another (a training run's rollouts run in parallel: one driver keeps one
PostgreSQL backend busy and leaves the other core idle), while the periodic jobs run beside them
in a thread as a deployment runs them (sandboxes.services.snapshots_collect, which enforces
retention; cache.services.tables_vacuum). At each checkpoint it writes a row: storage, nodes against
the budget, lookup latency, hits checked, and the misses of paths it recorded: evicted (the node is
gone) or lost (the node is there, yet the lookup missed: a defect).
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from dataclasses import dataclass, field

from django.db import connection

from cache.models import Node, Task
from cache.services import indexes_rebuild, node_record, tables_vacuum, task_flush, task_put, tcg_lookup
from cache.services.lookup import LookupHit
from cache.tcg import ToolCall, canonical_call, result_json
from cache.tcg.records import CallContext, CallRecord
from lab.bench.growth import Reservoir
from lab.figures import percentile
from sandboxes.services import snapshots_collect

log = logging.getLogger("tvcache.lab.soak")

ENV = {"backend": "external", "soak": "retention"}
TOOLS = {"read": {"mutates_state": False}}
CHOICE_WEIGHTS = (0.8, 0.15, 0.05)  # how often rollouts pick each popular call at a position
# Reported at each checkpoint, with the database: the graph, the history, and the counters a call
# updates (a counter table never vacuumed once grew to 97 MB for 128 rows here).
TABLES = (
    "cache_node",
    "cache_rolloutstep",
    "cache_rollout",
    "cache_toolstat",
    "cache_snapshot",
    "cache_tasktotal",
    "cache_rollouttotal",
)


@dataclass(frozen=True)
class Workload:
    calls: int = 20
    share: float = 0.9  # a rollout's j-th call is a popular one with probability share ** j
    drift: int = 10  # steps between moves of the policy
    stable: int = 2  # the first calls never change (clone, setup)

    def rollout_calls(self, step: int, rng: random.Random) -> list[ToolCall]:
        era = step // self.drift
        calls = []
        for j in range(self.calls):
            if rng.random() < self.share**j:
                choice = rng.choices(range(len(CHOICE_WEIGHTS)), CHOICE_WEIGHTS)[0]
                what = f"{j}-{choice}" + (f"-era{era}" if j >= self.stable else "")
            else:
                what = f"{j}-own-{rng.getrandbits(64):016x}"
            calls.append(ToolCall("read", {"path": what}) if j % 3 == 2 else ToolCall("bash", {"command": what}))
        return calls


def state_after(state: str, call: ToolCall) -> str:
    """The lab's own key of the state after a state-changing call (not the service's)."""
    return hashlib.sha256(state.encode() + b"\0" + canonical_call(call)).hexdigest()


def expected_result(task_id: str, state: str, call: ToolCall) -> dict:
    """What the call returns after that history: 64 to 1,600 bytes, unique to the history."""
    digest = hashlib.sha256(f"{task_id}\0{state}\0".encode() + canonical_call(call)).hexdigest()
    size = 64 + int(digest[:4], 16) % 1536
    return {"stdout": (digest * (size // 64 + 1))[:size], "exit_code": 0}


@dataclass
class Interval:
    """What happened since the last checkpoint."""

    lookup_ms: list[float] = field(default_factory=list)
    hits: int = 0
    misses: int = 0
    records: int = 0
    known_misses: list[int] = field(default_factory=list)  # node ids of recorded paths that missed


@dataclass
class Totals:
    calls: int = 0
    hits: int = 0
    hits_checked: int = 0
    wrong_hits: int = 0
    records: int = 0
    evicted_misses: int = 0  # a path recorded before, evicted since: a miss, as it should be
    lost: int = 0  # a path recorded before whose node is still there, yet the lookup missed


class Jobs:
    """The periodic jobs, in a thread, as a deployment's beat or in-process runner would run them."""

    def __init__(self, *, collect_every_s: float, vacuum_every_s: float, reindex_every_s: float):
        self.collect_every_s, self.vacuum_every_s, self.reindex_every_s = (
            collect_every_s,
            vacuum_every_s,
            reindex_every_s,
        )
        self.indexes_rebuilt: list[str] = []
        self.stop = threading.Event()
        self.nodes_evicted = 0
        self.rollouts_expired = 0
        self.rounds = 0
        self.round_ms: list[float] = []
        self.failures = 0
        self.thread = threading.Thread(target=self._run, name="soak-jobs", daemon=True)

    def __enter__(self) -> Jobs:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        vacuumed = reindexed = time.monotonic()
        try:
            while not self.stop.wait(self.collect_every_s):
                started = time.perf_counter()
                try:
                    done = snapshots_collect()
                    self.nodes_evicted += done.get("nodes_evicted", 0)
                    self.rollouts_expired += done.get("rollouts_expired", 0)
                    self.rounds += 1
                    self.round_ms.append((time.perf_counter() - started) * 1000)
                    if time.monotonic() - vacuumed > self.vacuum_every_s:
                        tables_vacuum()
                        vacuumed = time.monotonic()
                    if time.monotonic() - reindexed > self.reindex_every_s:
                        self.indexes_rebuilt += indexes_rebuild()
                        reindexed = time.monotonic()
                except Exception:
                    self.failures += 1
                    log.exception("a periodic job failed")
        finally:
            connection.close()


class _Driver:
    """One driver: its tasks' rollouts, one after another, and what it saw of them (its own sample
    of recorded paths, its own counts), so that drivers share nothing but the database."""

    def __init__(self, task_ids: list[str], soak: Soak, seed: int, sample: int):
        self.task_ids, self.soak = task_ids, soak
        self.rng = random.Random(seed)
        self.paths = Reservoir(sample, random.Random(seed + 1))  # (task, history, call, state) recorded
        self.known: dict[tuple[str, str, str], int] = {}  # (task, state, call digest) -> node id
        self.totals = Totals()
        self.interval = Interval()

    def step(self, step: int, deadline: float) -> bool:
        """Its tasks' rollouts of the training step; False if the deadline came first."""
        workload = self.soak.workload
        for task_id in self.task_ids:
            for rollout in range(self.soak.rollouts):
                if time.monotonic() > deadline:
                    return False
                calls = workload.rollout_calls(step, self.rng)
                self._rollout(task_id, f"s{step}-r{rollout}", step // workload.drift, calls)
        return True

    def _rollout(self, task_id: str, rollout_id: str, epoch: int, calls: list[ToolCall]) -> None:
        history: list[ToolCall] = []
        state = task_id
        for call in calls:
            context = CallContext(tuple(history), call, rollout_id, epoch, None)
            started = time.perf_counter()
            answer = tcg_lookup(task_id=task_id, context=context, resume=False)
            self.interval.lookup_ms.append((time.perf_counter() - started) * 1000)
            self.totals.calls += 1
            expected = expected_result(task_id, state, call)
            key = (task_id, state, canonical_call(call).decode())
            if isinstance(answer, LookupHit):
                self._hit(answer, expected, key)
            else:
                self._miss(task_id, context, expected, key, state)
            if call.tool != "read":
                history.append(call)
                state = state_after(state, call)

    def _hit(self, answer: LookupHit, expected: dict, key: tuple) -> None:
        self.interval.hits += 1
        self.totals.hits += 1
        self.totals.hits_checked += 1
        if answer.result_json != result_json(expected).decode():
            self.totals.wrong_hits += 1
            log.error("wrong hit: node %s for %s", answer.node_id, key)
        self.known[key] = answer.node_id

    def _miss(self, task_id: str, context: CallContext, expected: dict, key: tuple, state: str) -> None:
        self.interval.misses += 1
        if key in self.known:
            self.interval.known_misses.append(self.known[key])
        outcome = node_record(task_id=task_id, record=CallRecord(context, expected, 50.0))
        self.interval.records += 1
        self.totals.records += 1
        if key not in self.known:
            self.paths.offer((task_id, context.history, context.call, state))
        self.known[key] = outcome.node_id

    def audit(self) -> dict:
        """Look up every sampled recorded path again (uncounted: it must not keep what it reads
        alive): a hit must answer the recorded bytes; a miss must be of an evicted node."""
        hits = evicted = lost = wrong = 0
        for task_id, history, call, state in self.paths.items:
            context = CallContext(history, call, "", 0, None)
            answer = tcg_lookup(task_id=task_id, context=context, count=False, resume=False)
            key = (task_id, state, canonical_call(call).decode())
            if isinstance(answer, LookupHit):
                hits += 1
                wrong += answer.result_json != result_json(expected_result(task_id, state, call)).decode()
            elif Node.objects.filter(pk=self.known[key]).exists():
                lost += 1
            else:
                evicted += 1
        self.totals.wrong_hits += wrong
        self.totals.lost += lost
        return {"sampled": len(self.paths.items), "hits": hits, "evicted": evicted, "lost": lost, "wrong": wrong}

    def interval_taken(self) -> Interval:
        """What happened since the last checkpoint, the missed recorded paths told apart (evicted
        or lost) and counted in its totals."""
        interval, self.interval = self.interval, Interval()
        gone = set(interval.known_misses) - set(
            Node.objects.filter(pk__in=interval.known_misses).values_list("pk", flat=True)
        )
        lost = sum(1 for node_id in interval.known_misses if node_id not in gone)
        self.totals.evicted_misses += len(interval.known_misses) - lost
        self.totals.lost += lost
        return interval


class Soak:
    def __init__(
        self,
        *,
        tasks: int,
        rollouts: int,
        workload: Workload,
        max_nodes: int | None,
        max_result_bytes: int | None,
        prefix: str = "soak",
        sample: int = 4000,
        seed: int = 1,
        drivers: int = 1,
    ):
        self.task_ids = [f"{prefix}-{i:03d}" for i in range(tasks)]
        self.rollouts, self.workload = rollouts, workload
        self.max_nodes, self.max_result_bytes = max_nodes, max_result_bytes
        self.prefix = prefix
        self.synchronous_commit = True
        count = max(1, min(drivers, tasks))  # each its share of the tasks and of the audit's sample
        self.drivers = [
            _Driver(self.task_ids[i::count], self, seed + 1000 * i, max(1, sample // count)) for i in range(count)
        ]

    @property
    def totals(self) -> Totals:
        """The drivers' totals added up."""
        return Totals(**{name: sum(getattr(d.totals, name) for d in self.drivers) for name in vars(Totals())})

    def teardown(self, *, keep: bool = False) -> None:
        """Remove the soak's tasks (unless `keep`)."""
        if not keep:
            self.drop_existing()

    def drop_existing(self) -> None:
        for task_id in Task.objects.filter(pk__startswith=f"{self.prefix}-").values_list("pk", flat=True):
            task_flush(task_id=task_id)
            Task.objects.filter(pk=task_id).delete()

    def setup(self, *, synchronous_commit: bool = True) -> None:
        """The soak's tasks, afresh. Without `synchronous_commit`, the drivers' records do not wait
        for the disk (their connections only; the periodic jobs' commits still do)."""
        self.synchronous_commit = synchronous_commit
        self.drop_existing()
        retention = {"max_nodes": self.max_nodes, "max_result_bytes": self.max_result_bytes}
        for task_id in self.task_ids:
            task_put(task_id=task_id, env=ENV, tools=TOOLS, sandbox_budget=0, audit_rate=0.0, retention=retention)

    def step(self, step: int, deadline: float) -> bool:
        """Every task's rollouts of the training step, the drivers side by side (a thread and a
        connection each); False if the deadline came first. A driver's failure is raised here."""
        done: list[bool] = [False] * len(self.drivers)
        failed: list[BaseException] = []

        def drive(index: int) -> None:
            try:
                if not self.synchronous_commit:
                    with connection.cursor() as cursor:
                        cursor.execute("SET synchronous_commit = off")
                done[index] = self.drivers[index].step(step, deadline)
            except BaseException as exc:
                failed.append(exc)
            finally:
                connection.close()

        threads = [threading.Thread(target=drive, args=(i,), name=f"soak-driver-{i}") for i in range(len(self.drivers))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failed:
            raise failed[0]
        return all(done)

    def checkpoint(self, step: int, jobs: Jobs, elapsed_s: float) -> dict:
        intervals = [d.interval_taken() for d in self.drivers]
        hits, misses = sum(i.hits for i in intervals), sum(i.misses for i in intervals)
        lookup_ms = [ms for i in intervals for ms in i.lookup_ms]
        audits = [d.audit() for d in self.drivers]
        row = {
            "step": step,
            "elapsed_s": round(elapsed_s, 1),
            "calls": hits + misses,
            "hit_rate": round(hits / max(1, hits + misses), 3),
            "lookup_p50_ms": percentile(lookup_ms, 50, 3),
            "lookup_p99_ms": percentile(lookup_ms, 99, 3),
            "records": sum(i.records for i in intervals),
            "nodes": _nodes(self.task_ids),
            "sizes_bytes": _sizes(),
            "retention": {
                "rounds": jobs.rounds,
                "nodes_evicted": jobs.nodes_evicted,
                "rollouts_expired": jobs.rollouts_expired,
                "indexes_rebuilt": len(jobs.indexes_rebuilt),
                "round_p50_ms": percentile(jobs.round_ms, 50, 1),
                "round_max_ms": round(max(jobs.round_ms), 1) if jobs.round_ms else None,
                "failures": jobs.failures,
            },
            "audit": {key: sum(a[key] for a in audits) for key in audits[0]},
            "totals": dict(vars(self.totals)),
        }
        return row


def _nodes(task_ids: list[str]) -> dict:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*), coalesce(sum(result_bytes), 0) FROM cache_node WHERE task_id = ANY(%s) GROUP BY task_id",
            [task_ids],
        )
        per_task = cursor.fetchall()
    counts = [row[0] for row in per_task] or [0]
    return {
        "total": sum(counts),
        "max_per_task": max(counts),
        "result_bytes": sum(row[1] for row in per_task),
        "max_result_bytes_per_task": max((row[1] for row in per_task), default=0),
    }


def _sizes() -> dict:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname, pg_total_relation_size(oid) FROM pg_class WHERE relname = ANY(%s)", [list(TABLES)]
        )
        sizes = dict(cursor.fetchall())
        cursor.execute("SELECT pg_relation_size('cache_node'), pg_indexes_size('cache_node')")
        sizes["cache_node_heap"], sizes["cache_node_indexes"] = cursor.fetchone()
        cursor.execute("SELECT pg_database_size(current_database())")
        sizes["database"] = cursor.fetchone()[0]
    return sizes
