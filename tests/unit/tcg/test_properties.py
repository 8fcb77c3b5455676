"""Exactness of the core on random rollouts over a toy environment (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cache.tcg import ToolCall, chain_extended, env_fingerprint, state_chain
from cache.tcg.graph import Hit, ToolCallGraph

from .toy import POLICY, ToyEnvironment, fresh_result

keys = st.sampled_from(["a", "b"])
values = st.sampled_from(["x", "y"])
calls = st.one_of(
    st.builds(lambda k, v: ToolCall("write", {"key": k, "value": v}), keys, values),
    st.builds(lambda k, v: ToolCall("append", {"key": k, "value": v}), keys, values),
    st.builds(lambda k: ToolCall("read", {"key": k}), keys),
    st.just(ToolCall("keys", {})),
)
rollouts = st.lists(st.lists(calls, min_size=1, max_size=8), min_size=1, max_size=10)


def run_rollouts(
    graph: ToolCallGraph, batch: list[list[ToolCall]], snapshot_every: int, observe: bool = False
) -> tuple[int, int]:
    """Drive rollouts through the graph like a client would; return (cache hits, oracle hits).
    With `observe`, a miss reports whether the call changed the state, and the history a rollout
    sends keeps only the calls that did (a write of the value already there changes nothing).
    Every answer is checked against a fresh execution of everything the rollout issued."""
    snapshots: dict[int, ToyEnvironment] = {}
    hits = oracle_hits = 0
    for rollout in batch:
        issued: list[ToolCall] = []
        history: list[ToolCall] = []
        env: ToyEnvironment | None = None
        pending: list[ToolCall] = []
        for call in rollout:
            oracle_hits += graph.seen(history, call)
            answer = graph.lookup(history, call)
            if isinstance(answer, Hit):
                hits += 1
                assert answer.result == fresh_result(issued, call)
                changed = answer.mutates
                if env is not None and changed:
                    pending.append(call)
            else:
                if env is None:
                    env = snapshots[answer.resume.snapshot_id].fork() if answer.resume else ToyEnvironment()
                    pending = list(answer.replay)
                for replayed in pending:
                    env.execute(replayed)
                pending = []
                before = dict(env.state)
                result = env.execute(call)
                assert result == fresh_result(issued, call)
                observed = env.state != before if observe else None
                node_id = graph.record(history, call, result, mutated=observed)
                changed = POLICY.for_tool(call.tool).changes_state(observed)
                if changed and node_id % snapshot_every == 0:
                    snapshots[node_id] = env.fork()
                    graph.add_snapshot(node_id, node_id)
            issued.append(call)
            if changed or not observe:
                history.append(call)
    return hits, oracle_hits


@settings(max_examples=300, deadline=None)
@given(batch=rollouts, snapshot_every=st.integers(min_value=1, max_value=4))
def test_every_hit_equals_fresh_execution_and_hits_equal_oracle(batch, snapshot_every):
    graph = ToolCallGraph(env_fingerprint({"toy": 1}), POLICY)
    hits, oracle_hits = run_rollouts(graph, batch, snapshot_every)
    assert hits == oracle_hits


@settings(max_examples=300, deadline=None)
@given(batch=rollouts, snapshot_every=st.integers(min_value=1, max_value=4))
def test_calls_observed_to_change_nothing_keep_hits_exact(batch, snapshot_every):
    graph = ToolCallGraph(env_fingerprint({"toy": 1}), POLICY)
    hits, oracle_hits = run_rollouts(graph, batch, snapshot_every, observe=True)
    assert hits == oracle_hits


@settings(max_examples=100, deadline=None)
@given(batch=rollouts)
def test_second_epoch_of_the_same_rollouts_hits_every_call(batch):
    graph = ToolCallGraph(env_fingerprint({"toy": 1}), POLICY)
    run_rollouts(graph, batch, snapshot_every=2)
    hits, _ = run_rollouts(graph, batch, snapshot_every=2)
    assert hits == sum(len(rollout) for rollout in batch)


def test_reordered_read_only_calls_between_the_same_writes_still_hit():
    graph = ToolCallGraph(env_fingerprint({"toy": 1}), POLICY)
    write = ToolCall("write", {"key": "a", "value": "x"})
    read_a, read_b = ToolCall("read", {"key": "a"}), ToolCall("read", {"key": "b"})
    run_rollouts(graph, [[write, read_a, read_b]], snapshot_every=1)
    assert isinstance(graph.lookup([write], read_b), Hit)
    assert isinstance(graph.lookup([write, read_b], read_a), Hit)


def test_stale_read_misses_after_a_write():
    graph = ToolCallGraph(env_fingerprint({"toy": 1}), POLICY)
    read = ToolCall("read", {"key": "a"})
    first, second = ToolCall("write", {"key": "a", "value": "x"}), ToolCall("write", {"key": "a", "value": "y"})
    run_rollouts(graph, [[first, read]], snapshot_every=1)
    assert not isinstance(graph.lookup([first, second], read), Hit)


def test_changed_environment_never_hits():
    call = ToolCall("write", {"key": "a", "value": "x"})
    old = ToolCallGraph(env_fingerprint({"image": "v1"}), POLICY)
    old.record([], call, {"ok": True})
    new = ToolCallGraph(env_fingerprint({"image": "v2"}), POLICY)
    new._nodes = old._nodes  # same store, new fingerprint: keys differ
    assert not isinstance(new.lookup([], call), Hit)


@given(history=st.lists(calls, max_size=12), call=calls)
def test_a_chain_extended_by_a_call_is_the_chain_of_the_longer_history(history, call):
    fingerprint = env_fingerprint({"toy": 1})
    assert chain_extended(state_chain(fingerprint, history, POLICY), call, POLICY) == state_chain(
        fingerprint, [*history, call], POLICY
    )
