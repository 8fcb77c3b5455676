"""A miss reads only what its match needs of the history's nodes (lookup._PATH_SQL: the deepest that
exists, the nearest resumable snapshot above it by parent links; record.py: the nearest live
snapshot's cost), so that a miss costs the same after 10 calls or 1,000, and gives the match that
every node of the history gives (tcg.longest_prefix_match over _WRITES_SQL)."""

from __future__ import annotations

import random

import pytest
from django.db import connection

from cache.models import Node, Snapshot
from cache.services import LookupMiss, history_catch_up, node_record, task_put, tcg_lookup
from cache.services.lookup import _WRITES_SQL, SNAPSHOT_WALK, _node_refs
from cache.services.tasks import task_handle
from cache.tcg import ToolCall, longest_prefix_match, state_chain
from cache.tcg.records import CallContext, CallRecord, RecordedState

pytestmark = pytest.mark.django_db(transaction=True)


def call(name: str) -> ToolCall:
    return ToolCall("bash", {"command": name})


def record(task_id: str, history: list[ToolCall], made: ToolCall, exec_ms: float = 5.0) -> int:
    outcome = node_record(
        task_id=task_id,
        record=CallRecord(CallContext(tuple(history), made, "r", 0, None), {"stdout": made.args["command"]}, exec_ms),
        evicted=False,
    )
    return outcome.node_id


def full_match(task_id: str, history: tuple[ToolCall, ...]):
    """The match as every node of the history gives it."""
    task = task_handle(task_id=task_id)
    chain = state_chain(task.fingerprint, history, task.policy)
    with connection.cursor() as cursor:
        cursor.execute(_WRITES_SQL, {"task": task_id, "keys": ",".join(step.state_key for step in chain.writes)})
        rows = cursor.fetchone()[0]
    return longest_prefix_match(chain, _node_refs(rows or ()))


def described(match) -> tuple:
    return (
        match.matched,
        match.node.node_id if match.node else None,
        match.resume.node_id if match.resume else None,
        match.replay,
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_miss_matches_as_the_whole_history_would(seed):
    """Random trees of recorded calls, live snapshots on random nodes (some of states with live
    processes, some keeping them), histories that leave the tree at random depths: the miss's
    match is the one every node of its history gives."""
    rng = random.Random(seed)
    task_id = f"path-{seed}"
    task_put(task_id=task_id, env={"backend": "external", "path": seed}, sandbox_budget=64)
    paths: list[list[ToolCall]] = []
    nodes: list[int] = []
    for branch in range(6):
        base = rng.choice(paths)[: rng.randint(0, 12)] if paths else []
        history = list(base)
        for depth in range(rng.randint(3, 14)):
            made = call(f"b{branch} d{depth}")
            nodes.append(record(task_id, history, made))
            history.append(made)
        paths.append(history)
    for node_id in rng.sample(nodes, len(nodes) // 4):
        Node.objects.filter(pk=node_id).update(live_processes=rng.choice([0, 0, 1]))
        Snapshot.objects.create(
            task_id=task_id,
            node_id=node_id,
            backend="external",
            ref=f"snap-{node_id}",
            keeps_processes=rng.random() < 0.5,
        )
    for probe in range(40):
        history = rng.choice(paths)[: rng.randint(0, 26)]
        history = tuple(history) + tuple(call(f"off {probe} {i}") for i in range(rng.choice([0, 0, 1, 3])))
        answer = tcg_lookup(task_id=task_id, context=CallContext(history, call(f"new {probe}"), "r", 0, None))
        assert isinstance(answer, LookupMiss)
        assert described(answer.match) == described(full_match(task_id, history)), history


def test_a_snapshot_past_the_walk_is_not_used_and_the_miss_starts_from_the_root():
    """The walk up from the deepest node stops after SNAPSHOT_WALK links: a snapshot further up
    is left (slower, and as exact: the history is replayed from the root), one within it is used."""
    task_put(task_id="walk", env={"backend": "external", "walk": 1}, sandbox_budget=8)
    history: list[ToolCall] = []
    first = None
    for depth in range(SNAPSHOT_WALK + 2):
        made = call(f"d{depth}")
        node_id = record("walk", history, made)
        first = first or node_id
        history.append(made)
    Snapshot.objects.create(task_id="walk", node_id=first, backend="external", ref="far")
    far = tcg_lookup(task_id="walk", context=CallContext(tuple(history), call("next"), "r", 0, None))
    assert far.match.node is not None and far.match.resume is None and len(far.match.replay) == len(history)
    near = tcg_lookup(task_id="walk", context=CallContext(tuple(history[:SNAPSHOT_WALK]), call("next"), "r", 0, None))
    assert near.match.resume is not None and near.match.resume.node_id == first


def test_a_miss_reads_a_few_pages_of_a_task_the_statistics_do_not_know():
    """The lookup's statement, and the read of a history's nodes that a catch-up weighs, are index
    probes in a fixed order whatever the statistics say. A task that grew after the table was last
    analyzed (a new task in a long training: its rows are not in the statistics) looked small to
    the planner, which then read every state-changing node of it: on each miss (the state probe
    started from all of them, and found the history's node by the fingerprints' index), and on
    each catch-up (the history's keys were a filter over the task's nodes, not probes)."""
    task_put(task_id="known", env={"backend": "external", "stats": 1})
    for i in range(50):
        record("known", [], call(f"k{i}"))
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE cache_node")
    task_put(task_id="grown", env={"backend": "external", "stats": 2})
    for i in range(1500):  # one state each, all fingerprinted: candidates of the state probe
        node_record(
            task_id="grown",
            record=CallRecord(CallContext((), call(f"g{i}"), "r", 0, None), {"stdout": str(i)}, 5.0),
            state=RecordedState(full=f"full-{i}", shape=f"shape-{i}", order="order"),
            evicted=False,
        )
    pages = {}

    def explained(execute, sql, params, many, context):
        kind = "lookup" if sql.lstrip().startswith("WITH claimed") else "writes" if sql == _WRITES_SQL else None
        if kind:
            cursor = context["cursor"]
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params)
            plan = cursor.fetchone()[0][0]["Plan"]
            pages[kind] = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
        return execute(sql, params, many, context)

    with connection.execute_wrapper(explained):
        answer = tcg_lookup(task_id="grown", context=CallContext((call("g7"),), call("new"), "r", 0, None))
        history_catch_up(task_id="grown", history=(call("g7"), call("new")), applied=0)
    assert isinstance(answer, LookupMiss) and answer.match.matched == 1
    # the old statements: 774 pages for the lookup, 1,500 and more for the history's nodes
    assert pages.keys() == {"lookup", "writes"} and max(pages.values()) < 100, pages
