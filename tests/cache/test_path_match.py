"""A miss reads only what its match needs of the history's nodes (lookup._PATH_SQL: the deepest that
exists, the nearest resumable snapshot above it by parent links; record.py: the nearest live
snapshot's cost), so that a miss costs the same after 10 calls or 1,000, and gives the match that
every node of the history gives (tcg.longest_prefix_match over _WRITES_SQL)."""

from __future__ import annotations

import random

import pytest
from django.db import connection

from cache.models import Node, Snapshot
from cache.services import LookupMiss, node_record, task_put, tcg_lookup
from cache.services.lookup import _WRITES_SQL, SNAPSHOT_WALK, _node_refs
from cache.services.tasks import task_handle
from cache.tcg import ToolCall, longest_prefix_match, state_chain
from cache.tcg.records import CallContext, CallRecord

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
