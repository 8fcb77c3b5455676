"""A task's totals (nodes, top-level nodes, result bytes, states with processes, divergent nodes,
exec times by bucket) are kept as counters, not scanned: after records, divergences, subtree
evictions, flushes and a new environment, and under concurrent records, they equal a count of the
nodes there are; the stats and the migration that backfills them say the same."""

from __future__ import annotations

import random
import sys
import threading

import pytest
from django.db import connection, connections
from django.db.migrations.loader import MigrationLoader
from django.test.utils import CaptureQueriesContext

from cache.models import (
    Divergence,
    Node,
    Rollout,
    RolloutCall,
    RolloutStep,
    RolloutTotal,
    Snapshot,
    SnapshotTotal,
    Task,
    TaskTotal,
)
from cache.selectors import task_stats, task_totals
from cache.services import admin_subtree_evict, divergence_record, node_record, task_flush, task_put
from cache.tcg import RecordedState, ToolCall
from cache.tcg.exectimes import BUCKETS, bucket, histogram_median
from cache.tcg.records import CallContext, CallRecord
from sandboxes.selectors import pool_totals

pytestmark = pytest.mark.django_db(transaction=True)

ENV = {"backend": "external", "name": "totals"}
TOOLS = {"read": {"mutates_state": False}, "write": {}, "run": {}}


def counted(task_id: str) -> dict[str, dict]:
    """The totals as a scan of the task's nodes gives them (what the counters replace)."""
    out: dict[str, dict] = {}
    for tool, parent, size, mutates, processes, divergent, ms in Node.objects.filter(task_id=task_id).values_list(
        "tool", "parent_id", "result_bytes", "mutates", "live_processes", "divergent", "exec_ms"
    ):
        row = out.setdefault(
            tool,
            {"nodes": 0, "roots": 0, "result_bytes": 0, "process_states": 0, "divergent": 0, "buckets": [0] * BUCKETS},
        )
        row["nodes"] += 1
        row["roots"] += parent is None
        row["result_bytes"] += size
        row["process_states"] += mutates and processes > 0
        row["divergent"] += divergent
        row["buckets"][bucket(ms)] += 1
    return out


def kept(task_id: str) -> dict[str, dict]:
    out = {}
    for row in TaskTotal.objects.filter(task_id=task_id):
        if row.nodes == 0:  # every node of the tool gone: nothing else may be left over
            assert (row.roots, row.result_bytes, row.process_states, row.divergent) == (0, 0, 0, 0)
            assert set(row.exec_ms_buckets) == {0}
            continue
        out[row.tool] = {
            "nodes": row.nodes,
            "roots": row.roots,
            "result_bytes": row.result_bytes,
            "process_states": row.process_states,
            "divergent": row.divergent,
            "buckets": list(row.exec_ms_buckets),
        }
    return out


def exact(task_id: str) -> None:
    assert kept(task_id) == counted(task_id)
    stats = task_stats(task_id=task_id)
    nodes = Node.objects.filter(task_id=task_id)
    assert stats["nodes"] == nodes.count()
    assert stats["results_bytes"] == sum(nodes.values_list("result_bytes", flat=True))
    assert stats["processes"]["states"] == nodes.filter(mutates=True, live_processes__gt=0).count()
    assert stats["divergences"]["divergent_nodes"] == nodes.filter(divergent=True).count()


def rollout(task_id: str, calls: list[ToolCall], rng: random.Random, prefix: list[ToolCall] | None = None) -> list[int]:
    """Records `calls` one after the other (after `prefix`); the node ids."""
    history = list(prefix or [])
    ids = []
    for c in calls:
        state = RecordedState(processes=rng.choice((0, 0, 2))) if c.tool == "run" else RecordedState()
        result = {"out": "x" * rng.randint(1, 300)}
        record = CallRecord(CallContext(tuple(history), c, "r", 0, None), result, rng.uniform(0.1, 90_000))
        ids.append(node_record(task_id=task_id, record=record, state=state).node_id)
        history.append(c)
    return ids


def calls(tag: str, n: int) -> list[ToolCall]:
    tools = ("write", "read", "run")
    return [ToolCall(tools[i % 3], {"path": f"{tag}/{i}"}) for i in range(n)]


@pytest.fixture
def task() -> str:
    task_put(task_id="totals", env=ENV, tools=TOOLS, sandbox_budget=0, audit_rate=0.0)
    return "totals"


def test_totals_equal_a_count_after_records_divergences_evictions_and_a_flush(task):
    rng = random.Random(3)
    trunk = rollout(task, calls("trunk", 9), rng)
    branch = rollout(task, calls("branch", 6), rng, prefix=calls("trunk", 9)[:4])
    rollout(task, calls("other", 5), rng)
    again = rollout(task, calls("trunk", 9), rng)  # the same calls again: nothing new to count
    assert again == trunk
    exact(task)
    assert set(kept(task)) == {"write", "read", "run"} and kept(task)["write"]["roots"] == 2

    for node_id in (trunk[2], branch[1], branch[1]):  # the second mark of a node counts nothing
        tool = Node.objects.get(pk=node_id).tool
        divergence_record(task_id=task, node_id=node_id, tool=tool, kind="audit", expected=1, observed=2)
    assert Divergence.objects.filter(task_id=task).count() == 3
    exact(task)
    assert task_stats(task_id=task)["divergences"]["divergent_nodes"] == 2

    # A subtree holding a divergent node goes; the totals lose exactly its nodes.
    admin_subtree_evict(actor=None, task_id=task, node_id=branch[0])
    assert not Node.objects.filter(pk__in=branch).exists()
    exact(task)

    task_flush(task_id=task)
    assert kept(task) == {} and task_stats(task_id=task)["nodes"] == 0
    rollout(task, calls("after", 4), rng)
    exact(task)

    # A new environment drops the graph as a flush does.
    task_put(task_id=task, env={**ENV, "v": 2}, tools=TOOLS, sandbox_budget=0, audit_rate=0.0)
    assert kept(task) == {} and not Node.objects.filter(task_id=task).exists()


def _rollouts_with_history(task_id: str, n: int) -> list[int]:
    """`n` rollouts, each with a kept call and a step, as a tool-server rollout leaves them."""
    made = Rollout.objects.bulk_create(Rollout(task_id=task_id, rollout_id=f"h{i}", history_length=1) for i in range(n))
    RolloutCall.objects.bulk_create(RolloutCall(rollout=r, position=0, call={"tool": "write"}) for r in made)
    RolloutStep.objects.bulk_create(RolloutStep(rollout=r, applied=0, at=0, node_id=0, hit=False) for r in made)
    return [r.pk for r in made]


def test_a_flush_reads_no_node_and_leaves_none(task):
    """The flush deletes the graph and the rollouts in statements: it never loads the nodes or the
    rollouts' rows (a task of millions would not fit in the process), and leaves no node,
    divergence, snapshot, rollout, kept call or step of the task; another task keeps its own."""
    rng = random.Random(5)
    nodes = rollout(task, calls("trunk", 6), rng)
    divergence_record(task_id=task, node_id=nodes[2], tool="write", kind="audit", expected=1, observed=2)
    flushed = _rollouts_with_history(task, 3)
    task_put(task_id="other", env=ENV, tools=TOOLS, sandbox_budget=0, audit_rate=0.0)
    others = _rollouts_with_history("other", 2)
    with CaptureQueriesContext(connection) as queries:
        task_flush(task_id=task)
    selects = [q["sql"] for q in queries if q["sql"].startswith("SELECT")]
    assert not [
        sql for sql in selects if '"cache_node"."result_json"' in sql or '"cache_rollout"."trajectory_ref"' in sql
    ]
    assert not Node.objects.filter(task_id=task).exists() and not Divergence.objects.filter(task_id=task).exists()
    assert not Rollout.objects.filter(task_id=task).exists() and rollouts_kept(task) == 0
    assert not RolloutCall.objects.filter(rollout_id__in=flushed) and not RolloutStep.objects.filter(
        rollout_id__in=flushed
    )
    assert (
        RolloutCall.objects.filter(rollout_id__in=others).count()
        == RolloutStep.objects.filter(rollout_id__in=others).count()
        == 2
    )
    assert kept(task) == {} and task_stats(task_id=task)["nodes"] == 0
    exact(task)


def test_totals_stay_exact_when_records_race_a_subtree_eviction(task):
    """Rollouts record below a subtree and beside it while a maintainer evicts the subtree: a record
    either lands before the eviction (its node goes with the subtree) or fails on its deleted parent
    (nothing counted); the totals still equal the count."""
    rng = random.Random(5)
    base = calls("base", 3)
    trunk = rollout(task, base, rng)
    errors: list[BaseException] = []
    start = threading.Barrier(5)

    def record_many(worker: int) -> None:
        try:
            start.wait()
            history = list(base) if worker % 2 else []
            for i in range(15):
                c = ToolCall("write", {"path": f"w{worker}/{i}"})
                record = CallRecord(CallContext(tuple(history), c, f"r{worker}", 0, None), {"i": i}, 5.0)
                try:
                    node_record(task_id=task, record=record)
                except Exception as exc:  # a parent evicted under it: the record fails whole
                    errors.append(exc)
                history.append(c)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=record_many, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    start.wait()
    admin_subtree_evict(actor=None, task_id=task, node_id=trunk[0])
    for thread in threads:
        thread.join()
    exact(task)


def test_the_median_exec_time_comes_within_a_bucket_of_the_exact_one(task):
    rng = random.Random(7)
    rollout(task, calls("m", 60), rng)
    for tool, row in task_totals(task_id=task).items():
        times = sorted(Node.objects.filter(task_id=task, tool=tool).values_list("exec_ms", flat=True))
        exact_median = (times[(len(times) - 1) // 2] + times[len(times) // 2]) / 2
        # A bucket spans 2**(1/6) (12%) of 1 + t: the estimate is within that of the exact median.
        assert (1 + exact_median) / 1.123 <= 1 + row["median_exec_ms"] <= (1 + exact_median) * 1.123, tool
    assert histogram_median([0] * BUCKETS) is None


def test_the_migration_backfills_the_totals_of_existing_graphs(task):
    rng = random.Random(11)
    rollout(task, calls("old", 12), rng)
    node = Node.objects.filter(task_id=task, tool="run").first()
    Node.objects.filter(pk=node.pk).update(divergent=True)  # as the audit had marked it
    expected = counted(task)
    # The graph as it was before the migration: no totals; then the migration's backfill.
    TaskTotal.objects.all().delete()
    modules = [sys.modules[type(m).__module__] for (app, _), m in MigrationLoader(connection).disk_migrations.items()]
    (backfill,) = [module.BACKFILL_SQL for module in modules if hasattr(module, "BACKFILL_SQL")]
    with connection.cursor() as cursor:
        cursor.execute(backfill)
    assert kept(task) == expected and expected["run"]["divergent"] == 1


def snapshots_counted(task_id: str) -> dict[str, tuple[int, ...]]:
    """Per backend: live snapshots, their bytes, those keeping processes, evicted ones, as a scan
    of the snapshots gives them."""
    out: dict[str, list[int]] = {}
    for backend, status, size, processes in Snapshot.objects.filter(task_id=task_id).values_list(
        "backend", "status", "size_bytes", "keeps_processes"
    ):
        row = out.setdefault(backend, [0, 0, 0, 0])
        row[0] += status == "live"
        row[1] += (size or 0) if status == "live" else 0
        row[2] += status == "live" and processes
        row[3] += status == "evicted"
    return {backend: tuple(row) for backend, row in out.items() if any(row)}


def snapshots_kept(task_id: str) -> dict[str, tuple[int, ...]]:
    rows = SnapshotTotal.objects.filter(task_id=task_id).values_list(
        "backend", "live", "live_bytes", "live_processes", "evicted"
    )
    return {backend: tuple(counts) for backend, *counts in rows if any(counts)}


def test_snapshot_totals_follow_inserts_status_changes_and_cascades(task):
    """Every way a snapshot row changes (created, evicted, deleted by the reaper, gone with its
    node's subtree, with a flush, with its task) leaves the totals equal to a scan, and stats and
    the pools totals read them."""
    rng = random.Random(5)
    trunk = rollout(task, calls("trunk", 8), rng)
    branch = rollout(task, calls("branch", 4), rng, prefix=calls("trunk", 8)[:3])
    made = []
    for i, node_id in enumerate([*trunk, *branch]):
        backend = "docker" if i % 3 else "folder"
        size = None if i == 4 else 1000 + i
        made.append(
            Snapshot.objects.create(
                task_id=task, node_id=node_id, backend=backend, ref=f"s{i}", size_bytes=size, keeps_processes=i % 2 == 0
            )
        )
    assert snapshots_kept(task) == snapshots_counted(task) and snapshots_kept(task)["docker"][0] == 8
    Snapshot.objects.filter(pk__in=[s.pk for s in made[:5]]).update(status=Snapshot.Status.EVICTED)
    Snapshot.objects.filter(pk=made[0].pk).update(status=Snapshot.Status.DELETED)
    Snapshot.objects.filter(pk=made[6].pk).update(size_bytes=5)
    assert snapshots_kept(task) == snapshots_counted(task)
    stats = task_stats(task_id=task)["snapshots"]
    live = Snapshot.objects.filter(task_id=task, status="live")
    assert stats == {
        "live": live.count(),
        "live_bytes": sum(s or 0 for s in live.values_list("size_bytes", flat=True)),
        "evicted": 4,
    }
    assert pool_totals()["snapshots"] == live.count()
    assert task_stats(task_id=task)["processes"]["snapshots"] == live.filter(keeps_processes=True).count()
    admin_subtree_evict(actor=None, task_id=task, node_id=branch[0])  # snapshots go with their nodes
    assert snapshots_kept(task) == snapshots_counted(task)
    task_flush(task_id=task)
    assert snapshots_kept(task) == snapshots_counted(task) == {}
    rollout(task, calls("again", 3), rng)
    Snapshot.objects.create(
        task_id=task, node_id=Node.objects.filter(task_id=task).first().pk, backend="sqlite", ref="x"
    )
    assert snapshots_kept(task) == {"sqlite": (1, 0, 0, 0)}
    Task.objects.filter(pk=task).delete()  # cascades to its totals and its snapshots: nothing left behind
    assert not SnapshotTotal.objects.filter(task_id=task).exists()


def test_the_migration_fills_the_snapshot_totals_of_existing_snapshots(task):
    ids = rollout(task, calls("old", 4), random.Random(2))
    for i, node_id in enumerate(ids):
        Snapshot.objects.create(task_id=task, node_id=node_id, backend="docker", ref=f"o{i}", size_bytes=10)
    Snapshot.objects.filter(node_id=ids[0]).update(status=Snapshot.Status.EVICTED)
    expected = snapshots_counted(task)
    module = sys.modules[
        type(MigrationLoader(connection).disk_migrations[("cache", "0022_snapshot_totals")]).__module__
    ]
    with connection.cursor() as cursor:
        cursor.execute(module.UNTRIGGERS)
        cursor.execute("DELETE FROM cache_snapshottotal")
        cursor.execute(module.TRIGGERS)
    assert snapshots_kept(task) == expected == {"docker": (3, 30, 0, 1)}


def rollouts_kept(task_id: str) -> int | None:
    return RolloutTotal.objects.filter(task_id=task_id).values_list("rollouts", flat=True).first()


def test_rollout_totals_follow_every_way_a_rollout_comes_and_goes(task):
    """A claim's, a counter flush's and a bulk insert's rollouts, deleted ones and a task's delete
    leave the count equal to the rows there are, and stats read it."""
    from cache import ledger
    from cache.services import rollout_claim, rollout_unclaim

    for name in ("c1", "c2", "c1"):  # made by its first claim, once
        rollout_unclaim(rollout_pk=rollout_claim(task_id=task, rollout_id=name).rollout.pk)
    ledger.lookup_add(
        task_id=task, epoch=0, tool="write", rollout_id="counted", node_id=None, hit=False, seen=False, saved_ms=0.0
    )
    ledger.ledger_flush()  # a rollout the counters made
    Rollout.objects.bulk_create(Rollout(task_id=task, rollout_id=f"b{i}") for i in range(4))  # as branches are made
    assert rollouts_kept(task) == Rollout.objects.filter(task_id=task).count() == 7
    assert task_stats(task_id=task)["rollouts"] == 7
    Rollout.objects.filter(task_id=task, rollout_id__startswith="b").exclude(rollout_id="b0").delete()
    assert rollouts_kept(task) == task_stats(task_id=task)["rollouts"] == 4
    Task.objects.filter(pk=task).delete()  # cascades to its rollouts and its total: nothing left behind
    assert rollouts_kept(task) is None


def test_the_migration_fills_the_rollout_totals_of_existing_rollouts(task):
    Rollout.objects.bulk_create(Rollout(task_id=task, rollout_id=f"old{i}") for i in range(3))
    module = sys.modules[type(MigrationLoader(connection).disk_migrations[("cache", "0024_rollout_totals")]).__module__]
    with connection.cursor() as cursor:
        cursor.execute(module.UNTRIGGERS)
        cursor.execute("DELETE FROM cache_rollouttotal")
        cursor.execute(module.TRIGGERS)
    assert rollouts_kept(task) == 3
