from cache.tcg import NodeRef, ToolCall, env_fingerprint, longest_prefix_match, state_chain

from .toy import POLICY

W1, W2, W3 = (ToolCall("write", {"key": "a", "value": v}) for v in "123")
R = ToolCall("read", {"key": "a"})
FP = env_fingerprint({"toy": 1})


def refs(chain, indexes, snapshots=()):
    writes = chain.writes
    return {
        writes[i].state_key: NodeRef(node_id=i + 1, state_key=writes[i].state_key, depth=i + 1,
                                     snapshot_id=(i + 1) if i in snapshots else None)
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
