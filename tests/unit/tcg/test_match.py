from dataclasses import replace

from cache.tcg import NodeRef, ToolCall, catch_up, env_fingerprint, longest_prefix_match, state_chain

from .toy import POLICY

W1, W2, W3 = (ToolCall("write", {"key": "a", "value": v}) for v in "123")
R = ToolCall("read", {"key": "a"})
FP = env_fingerprint({"toy": 1})


def refs(chain, indexes, snapshots=(), cum=None):
    writes = chain.writes
    return {
        writes[i].state_key: NodeRef(
            node_id=i + 1,
            state_key=writes[i].state_key,
            depth=i + 1,
            cum_exec_ms=cum[i] if cum else 0.0,
            snapshot_id=(i + 1) if i in snapshots else None,
        )
        for i in indexes
    }


def test_no_node_means_fresh_sandbox_and_full_replay():
    chain = state_chain(FP, [R, W1, R, W2], POLICY)
    match = longest_prefix_match(chain, {})
    assert (match.matched, match.node, match.resume, match.replay) == (1, None, None, (W1, W2))


def test_deepest_node_and_resume_from_shallower_snapshot_replays_the_suffix():
    chain = state_chain(FP, [W1, R, W2, W3, R], POLICY)
    match = longest_prefix_match(chain, refs(chain, [0, 1, 2], snapshots=[0]))
    assert match.matched == 5
    assert match.node.node_id == 3
    assert match.resume.node_id == 1
    assert match.replay == (W2, W3)


def test_matched_stops_before_the_first_unmatched_write():
    chain = state_chain(FP, [W1, R, W2, R, W3], POLICY)
    match = longest_prefix_match(chain, refs(chain, [0], snapshots=[0]))
    assert match.matched == 2
    assert match.replay == (W2, W3)


def test_read_only_calls_do_not_change_the_state_key():
    assert state_chain(FP, [W1, R, R], POLICY).final == state_chain(FP, [W1], POLICY).final
    assert state_chain(FP, [W1, W2], POLICY).final != state_chain(FP, [W2, W1], POLICY).final


def test_a_sandbox_behind_forks_a_snapshot_past_it_only_when_that_costs_less_than_replaying():
    chain = state_chain(FP, [W1, R, W2, W3], POLICY)  # W2 is slow: 2 s; a restore costs 300 ms
    found = refs(chain, [0, 1, 2], snapshots=[1], cum=[10.0, 2010.0, 2020.0])
    plan = catch_up(chain, found, applied=1, restore_ms=300.0)  # the sandbox holds W1's state
    assert plan.replay_ms == 2010.0
    assert (plan.fork.resume.node_id, plan.fork.replay) == (2, (W3,))
    assert catch_up(chain, found, applied=1, restore_ms=2500.0).fork is None  # restoring costs more
    assert catch_up(chain, found, applied=3, restore_ms=0.0).fork is None  # already past the snapshot
    cheap = refs(chain, [0, 1, 2], snapshots=[1], cum=[10.0, 20.0, 30.0])
    assert catch_up(chain, cheap, applied=1, restore_ms=300.0).fork is None  # quick calls: replay them


def test_nothing_to_plan_without_every_write_node_or_once_caught_up():
    chain = state_chain(FP, [W1, W2], POLICY)
    assert catch_up(chain, refs(chain, [1], snapshots=[1], cum=[0.0, 10.0]), applied=0, restore_ms=0.0) is None
    assert catch_up(chain, refs(chain, [0, 1], cum=[5.0, 10.0]), applied=2, restore_ms=0.0) is None
    plan = catch_up(chain, refs(chain, [0, 1], cum=[5.0, 10.0]), applied=0, restore_ms=0.0)
    assert (plan.replay_ms, plan.fork) == (10.0, None)  # no snapshot to fork


def test_a_snapshot_of_a_state_with_live_processes_is_resumed_only_if_it_keeps_them():
    chain = state_chain(FP, [W1, W2, W3], POLICY)
    found = refs(chain, [0, 1, 2], snapshots=[0, 1])
    # W2 left a server running: its snapshot holds only files, so the match resumes from W1's and
    # replays W2 (which starts the server again) and W3.
    found[chain.writes[1].state_key] = replace(found[chain.writes[1].state_key], processes=1)
    match = longest_prefix_match(chain, found)
    assert (match.resume.node_id, match.replay) == (1, (W2, W3))
    # A checkpoint keeps them: it stands in for the state.
    found[chain.writes[1].state_key] = replace(found[chain.writes[1].state_key], snapshot_keeps_processes=True)
    assert longest_prefix_match(chain, found).resume.node_id == 2
    # The server still runs at W1's state too: no snapshot stands in, a fresh sandbox replays all.
    found[chain.writes[0].state_key] = replace(found[chain.writes[0].state_key], processes=2)
    found[chain.writes[1].state_key] = replace(found[chain.writes[1].state_key], snapshot_keeps_processes=False)
    match = longest_prefix_match(chain, found)
    assert (match.resume, match.replay) == (None, (W1, W2, W3))
    # A sandbox behind catches up by replaying rather than forking such a snapshot.
    costly = {key: replace(ref, cum_exec_ms=1000.0 * ref.depth) for key, ref in found.items()}
    assert catch_up(chain, costly, applied=0, restore_ms=0.0).fork is None
