"""The growth benchmark (`manage.py bench_growth`) at tiny sizes: the bulk-seeded rows are the
service's own (a seeded path hits its node, recording it again finds it), and the command measures
every operation against a live service and reports each size. Tests of the harness, not of timings."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command

from cache.models import Node, Rollout, RolloutStep, Snapshot, Task
from cache.services import LookupHit, node_record, tcg_lookup
from cache.tcg.records import CallContext, CallRecord
from lab.bench.growth import GraphGrowth

pytestmark = pytest.mark.django_db(transaction=True)

OPERATIONS = {
    "lookup hit (shallow)",
    "lookup hit (deep)",
    "lookup miss",
    "record",
    "tool-server hit",
    "stats",
    "graph (a group's subtree)",
    "tree export (100 rollouts)",
    "graph (whole, as exported)",
    "graph (a page of 1,000 nodes from depth 10)",
    "page: overview",
    "page: task",
    "page: graph",
    "page: pools",
    "page: tree",
    "page: node (deep)",
}


def test_seeded_paths_hit_their_nodes_and_recording_them_again_creates_nothing():
    growth = GraphGrowth(prefix="growth-test", rollout_share=1.0, snapshot_share=0.5, sample=50)
    growth.grow_to(500)
    task = growth.measured_task
    assert Node.objects.filter(task_id=task).count() == growth.totals["nodes"] >= 500
    assert Snapshot.objects.filter(task_id=task, status="live").count() == growth.totals["snapshots"] > 0
    assert Rollout.objects.filter(task_id=task).count() == growth.totals["rollouts"] > 0
    assert RolloutStep.objects.filter(rollout__task_id=task).count() == growth.totals["steps"]
    samples = growth.shallow.items[:10] + growth.deep.items[:10]
    for sample in samples:
        context = CallContext(sample.history, sample.call, "check", 0, None)
        answer = tcg_lookup(task_id=task, context=context, count=False)
        assert isinstance(answer, LookupHit) and answer.node_id == sample.node_id
        outcome = node_record(task_id=task, record=CallRecord(context, {"output": "", "ok": True}, 1.0))
        assert (outcome.node_id, outcome.created) == (sample.node_id, False)
    # A seeded node's parent is its history's last state-changing node, as record.py links it.
    deep = Node.objects.get(pk=growth.deep.items[0].node_id)
    assert deep.parent is not None and deep.parent.mutates and deep.parent.state_key == deep.anchor_key
    growth.drop_existing()
    assert not Task.objects.filter(pk__startswith="growth-test").exists()


@pytest.mark.parametrize("mode", ["one", "many"])
def test_the_command_measures_every_operation_at_each_size(tmp_path, mode):
    out = tmp_path / "growth.json"
    printed = io.StringIO()
    call_command(
        "bench_growth",
        sizes="200,1000",
        tasks_mode=mode,
        nodes_per_task=300,
        requests=4,
        page_requests=2,
        heavy_requests=1,
        warmup=1,
        workers=1,
        out=str(out),
        stdout=printed,
    )
    report = json.loads(out.read_text())
    assert [row["nodes"] >= size for row, size in zip(report["rows"], (200, 1000))] == [True, True]
    for index, row in enumerate(report["rows"]):
        assert set(row["operations"]) == OPERATIONS
        for name, figure in row["operations"].items():
            # Seeded hits hit their nodes, misses miss, records create, every page answers 200.
            assert figure["n"] >= 1 and figure["wrong"] == 0, (name, figure)
            assert 0 < figure["p50_ms"] <= figure["p99_ms"]
        assert row["storage"]["rows"] == row["nodes"] + (index + 1) * (4 + 1)  # and the nodes records added
        assert row["storage"]["per_node"]["total"] > row["storage"]["column_avg_bytes"]["anchor_key"] > 0
        assert row["plans"]["lookup: node by key"]["plan"][0].startswith("Index Scan using node_unique_key")
    tasks = report["rows"][-1]["totals"]["tasks"]
    assert tasks == 1 if mode == "one" else tasks > 1
    assert "| lookup hit (deep) |" in printed.getvalue()
    assert not Task.objects.filter(pk__startswith=f"growth-{mode}").exists()  # removed without --keep
