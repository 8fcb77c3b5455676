"""Retention (cache/tcg/eviction.py): which results a task over its bounds loses, with no database."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from cache.tcg.eviction import NodeCandidate, RetentionBudget, node_reuse_score, retention_order


def node(node_id: int, parent_id: int | None = None, **kw) -> NodeCandidate:
    base = {"depth": 1, "result_bytes": 100, "hit_count": 0, "exec_ms": 10.0, "idle_s": 7200.0}
    return NodeCandidate(node_id=node_id, parent_id=parent_id, **{**base, **kw})


def chain(first: int, length: int, parent: int | None = None, **kw) -> list[NodeCandidate]:
    """Nodes first..first+length-1, each the parent of the next."""
    out = []
    for i in range(length):
        out.append(node(first + i, parent, depth=i + 1, **kw))
        parent = first + i
    return out


def test_within_budget_or_unbounded_nothing_is_evicted():
    nodes = chain(1, 5)
    assert retention_order(nodes, RetentionBudget()) == []
    assert retention_order(nodes, RetentionBudget(max_nodes=5, max_result_bytes=500)) == []


def test_the_cold_subtree_goes_leaves_first_and_the_hot_one_stays():
    hot = chain(1, 3, hit_count=50, idle_s=10.0)
    cold = chain(10, 3, parent=1)  # hangs off the hot root, cold itself
    order = retention_order(hot + cold, RetentionBudget(max_nodes=3))
    assert order == [12, 11, 10]


def test_a_parent_is_never_evicted_before_its_children_even_when_colder():
    # The parent is cold, its child hot: the child's value covers the path to it.
    nodes = [node(1, idle_s=1e6), node(2, 1, depth=2, hit_count=100, idle_s=0.0), node(3, idle_s=1e5)]
    assert retention_order(nodes, RetentionBudget(max_nodes=2)) == [3]
    assert retention_order(nodes, RetentionBudget(max_nodes=0)) == [3, 2, 1]


def test_protected_nodes_and_their_ancestors_are_spared_so_the_task_may_stay_over():
    nodes = [*chain(1, 4), node(9, 2, depth=3)]
    protected = [n if n.node_id != 4 else node(4, 3, depth=4, protected=True) for n in nodes]
    assert retention_order(protected, RetentionBudget(max_nodes=0)) == [9]


def test_only_bytes_over_evicts_the_big_cold_result_first():
    nodes = [node(1, result_bytes=10), node(2, result_bytes=10_000), node(3, result_bytes=10)]
    assert retention_order(nodes, RetentionBudget(max_result_bytes=5_000)) == [2]
    # Over on nodes too: value decides, and the bigger of equals goes first.
    assert retention_order(nodes, RetentionBudget(max_nodes=2, max_result_bytes=5_000)) == [2]


def test_recent_hits_and_expensive_calls_are_worth_more():
    base = node(1)
    assert node_reuse_score(node(1, hit_count=5)) > node_reuse_score(base)
    assert node_reuse_score(node(1, idle_s=0.0)) > node_reuse_score(base)
    assert node_reuse_score(node(1, exec_ms=1000.0)) > node_reuse_score(base)
    assert node_reuse_score(node(1, depth=10)) < node_reuse_score(base)


def test_a_deep_chain_needs_no_recursion():
    nodes = chain(1, 20_000)
    assert retention_order(nodes, RetentionBudget(max_nodes=19_990)) == list(range(20_000, 19_990, -1))


@st.composite
def forests(draw):
    count = draw(st.integers(min_value=1, max_value=60))
    rng = random.Random(draw(st.integers(0, 2**32)))
    nodes = []
    for node_id in range(1, count + 1):
        parent = rng.choice([None, *range(1, node_id)]) if node_id > 1 else None
        nodes.append(
            node(
                node_id,
                parent,
                result_bytes=rng.randint(1, 5000),
                hit_count=rng.randint(0, 20),
                idle_s=rng.uniform(0, 20_000),
                protected=rng.random() < 0.1,
            )
        )
    budget = RetentionBudget(
        max_nodes=draw(st.none() | st.integers(0, count)), max_result_bytes=draw(st.none() | st.integers(0, 100_000))
    )
    return nodes, budget


@settings(max_examples=300, deadline=None)
@given(forests())
def test_every_prefix_of_the_order_keeps_what_stays_closed_under_parents(case):
    nodes, budget = case
    by_id = {n.node_id: n for n in nodes}
    order = retention_order(nodes, budget)
    assert len(order) == len(set(order))
    gone: set[int] = set()
    for node_id in order:
        gone.add(node_id)
        # Everything below it went before it: what stays keeps every node's parent.
        assert all(n.node_id in gone for n in nodes if n.parent_id == node_id)
        assert not by_id[node_id].protected
    protected_paths = set()
    for n in nodes:
        walk = n if n.protected else None
        while walk is not None:
            protected_paths.add(walk.node_id)
            walk = by_id.get(walk.parent_id)
    assert not gone & protected_paths
    # It stops once within the budget, and only stops short when nothing more may go.
    kept = [n for n in nodes if n.node_id not in gone]
    nodes_over, bytes_over = budget.over(len(kept), sum(n.result_bytes for n in kept))
    if nodes_over or bytes_over:
        evictable = {n.node_id for n in kept} - protected_paths
        assert not evictable
    if order:
        before = [n for n in nodes if n.node_id not in gone or n.node_id == order[-1]]
        assert any(budget.over(len(before), sum(n.result_bytes for n in before)))
