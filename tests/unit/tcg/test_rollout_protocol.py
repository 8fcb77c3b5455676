"""The rollout protocol's decisions (cache/tcg/rollout.py), without I/O."""

from __future__ import annotations

import pytest

from cache.tcg.rollout import Act, Looked, Ran, RolloutCall

KEY = ("task", "anchor", "digest")
MISS = Looked(hit=False, flight_key=KEY)


def test_a_hit_is_served_and_joins_the_history_only_if_it_changes_state():
    for mutates in (True, False):
        protocol = RolloutCall(detached=False)
        assert protocol.start().act is Act.LOOKUP
        step = protocol.looked_up(Looked(hit=True, mutates=mutates))
        assert (step.act, step.append) == (Act.SERVE, mutates)


def test_a_leader_executes_records_and_appends_what_changed_state():
    protocol = RolloutCall(detached=False)
    protocol.start()
    step = protocol.looked_up(MISS)
    assert (step.act, step.key) == (Act.LEAD, KEY)
    assert protocol.lead_tried(True, KEY).act is Act.EXECUTE
    assert protocol.executed(Ran.KNOWN).act is Act.RECORD
    step = protocol.recorded(mutates=True)
    assert (step.act, step.append) == (Act.DONE, True)
    assert protocol.trace == ["lookup", "lead", "execute", "record", "done"]


def test_a_miss_nobody_coordinates_executes_at_once():
    protocol = RolloutCall(detached=False)
    protocol.start()
    assert protocol.looked_up(Looked(hit=False)).act is Act.EXECUTE


def test_a_waiter_looks_up_again_and_takes_the_leaders_result():
    protocol = RolloutCall(detached=False)
    protocol.start()
    protocol.looked_up(MISS)
    assert protocol.lead_tried(False, KEY).act is Act.AWAIT
    assert protocol.awaited(timed_out=False).act is Act.LOOKUP
    assert protocol.looked_up(Looked(hit=True, mutates=True)).act is Act.SERVE
    assert protocol.trace == ["lookup", "lead", "await", "lookup", "serve"]


def test_a_waiter_that_leads_after_the_wait_executes_without_a_second_claim():
    protocol = RolloutCall(detached=False)
    protocol.start()
    protocol.looked_up(MISS)
    protocol.lead_tried(False, KEY)
    protocol.awaited(timed_out=False)  # the leader failed: the claim is this rollout's now
    assert protocol.looked_up(MISS).act is Act.EXECUTE


def test_a_waiter_past_its_limit_executes_alongside():
    protocol = RolloutCall(detached=False)
    protocol.start()
    protocol.looked_up(MISS)
    protocol.lead_tried(False, KEY)
    assert protocol.awaited(timed_out=True).act is Act.EXECUTE
    late = RolloutCall(detached=False, may_wait=False)
    late.start()
    late.looked_up(MISS)
    assert late.lead_tried(False, KEY).act is Act.EXECUTE


def test_on_a_fast_lane_a_miss_moves_before_any_work():
    protocol = RolloutCall(detached=False, fast_lane=True)
    protocol.start()
    assert protocol.looked_up(MISS).act is Act.MOVE
    assert protocol.trace == ["lookup", "move"]  # no lead, no execution
    assert RolloutCall(detached=True, fast_lane=True).start().act is Act.MOVE
    assert RolloutCall(detached=False, fast_lane=True).start(servable=False).act is Act.MOVE


def test_a_detached_rollout_runs_as_it_is_and_a_call_never_served_is_executed():
    assert RolloutCall(detached=True).start().act is Act.RUN_AS_IS
    assert RolloutCall(detached=False).start(servable=False).act is Act.EXECUTE


@pytest.mark.parametrize(
    ("ran", "rebuilds", "act"),
    [
        (Ran.KNOWN, False, Act.RECORD),
        (Ran.REFUSED, True, Act.DONE),
        (Ran.UNKNOWN, True, Act.DETACH),  # the call's own effects: never rebuilt
        (Ran.UNKNOWN, False, Act.DETACH),
        (Ran.ENV_FAILED, True, Act.RETIRE),  # the environment failed: rebuilt from the history
        (Ran.ENV_FAILED, False, Act.DETACH),
    ],
)
def test_the_known_state_rule(ran, rebuilds, act):
    protocol = RolloutCall(detached=False, rebuilds=rebuilds)
    protocol.start()
    protocol.looked_up(Looked(hit=False))
    step = protocol.executed(ran, reason="why")
    assert step.act is act
    if act in (Act.DETACH, Act.RETIRE):
        assert step.reason == "why"
