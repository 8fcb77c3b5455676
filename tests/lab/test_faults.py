"""The fault arm's plan and bookkeeping, without a service: which rollouts meet which fault, how
the known-state rule marks a rollout's calls, and what the oracle lets them hit."""

from __future__ import annotations

from lab.replay.faults import FaultPlan, divergence_count
from lab.replay.report import issued_oracle
from lab.replay.samples import CallSample, EpochRun, mark_unknown_state
from lab.replay.sql import SqlWorkload
from lab.replay.terminal import TerminalWorkload


def terminal(seed: int) -> TerminalWorkload:
    return TerminalWorkload(tasks=4, rollouts=8, seed=seed)


def test_plan_is_seeded_bounded_and_spares_calls_a_replay_would_repeat():
    workload = terminal(5)
    plan = FaultPlan(seed=5, rate=0.5)
    chosen = []
    for task in workload.tasks():
        for epoch in range(3):
            for index, calls in enumerate(workload.rollouts(task, epoch)):
                fault = plan.choose(workload, task.name, epoch, index, calls)
                assert fault == FaultPlan(seed=5, rate=0.5).choose(workload, task.name, epoch, index, calls)
                chosen.append(fault)
                if fault is None:
                    continue
                assert fault.kind in workload.fault_kinds and 0 <= fault.position < len(calls)
                if fault.kind == "error_after":  # a replay of an earlier, equal call must not fire it
                    assert fault.position > 0 and calls[fault.position] not in calls[: fault.position]
                if fault.kind == "timeout":
                    assert calls[fault.position]["args"]["command"].startswith("sleep 2 ")
                    world = plan.world(workload, calls, fault)
                    assert world[fault.position]["args"]["timeout_s"] == plan.timeout_s
                    assert world[: fault.position] == calls[: fault.position]
                    assert world[fault.position + 1 :] == calls[fault.position + 1 :]
    faulted = [f for f in chosen if f is not None]
    assert 0.3 * len(chosen) < len(faulted) < 0.6 * len(chosen)
    assert {f.kind for f in faulted} == {"timeout", "error_after", "sandbox_death"}
    assert (
        FaultPlan(seed=5, rate=0.0).choose(workload, "c-build", 0, 0, workload.rollouts(workload.tasks()[0], 0)[0])
        is None
    )


def test_kinds_apply_to_their_modes_and_timeouts_only_where_the_kill_point_is_fixed():
    plan = FaultPlan(seed=1, rate=1.0)
    workload = terminal(1)
    calls = workload.rollouts(workload.tasks()[2], 0)[0]  # git-ops: no call starts with a sleep
    assert all(workload.timeout_call(call, 1.0) is None for call in calls)
    assert plan.world(workload, calls, None) == calls
    sql = SqlWorkload(tasks=1, rollouts=2, seed=1, latency_ms=0, rows=80)
    try:
        assert sql.timeout_call({"tool": "query", "args": {"sql": "SELECT 1"}}, 1.0) is None
        assert set(sql.fault_kinds) == {"error_after", "timeout_after"}
    finally:
        sql.close()
    assert plan.restart_point("server", 3, 100)[0] == 1 and plan.restart_point("server", 1, 100)[0] == 0
    assert 30 <= plan.restart_point("client", 3, 100)[1] <= 60
    assert FaultPlan(seed=1, restart=False).restart_point("server", 3, 100) is None


def sample(rollout: int, position: int, key: str, *, cached: bool, result=None, **fields) -> CallSample:
    out = CallSample(
        "t",
        0,
        rollout,
        position,
        "bash",
        1.0,
        cached,
        None,
        "",
        result=result or {"stdout": key},
        started=rollout * 0.001 + position,
        key=("state", key),
        **fields,
    )
    return out


def test_known_state_rule_marks_the_calls_after_an_event():
    timed = [
        sample(0, 0, "a", cached=False),
        sample(0, 1, "b", cached=False, result={"timed_out": True}),
        sample(0, 2, "c", cached=False),
    ]
    mark_unknown_state(timed)
    assert [(s.event, s.unshared) for s in timed] == [(False, False), (True, False), (False, True)]
    death = [sample(1, 0, "a", cached=True), sample(1, 1, "b", cached=False, fault="sandbox_death")]
    mark_unknown_state(death)
    # A sandbox dying between calls leaves the state known: the rollout goes on from its history.
    assert [(s.event, s.unshared) for s in death] == [(False, False), (False, False)]
    injected = [sample(2, 0, "a", cached=False, injected=True), sample(2, 1, "b", cached=True)]
    mark_unknown_state(injected)
    assert [(s.event, s.unshared) for s in injected] == [(True, False), (False, True)]


def test_oracle_keeps_a_rollout_after_its_event_to_its_own_branch():
    # Rollout 0 times out at its second call; rollout 1, later, makes the same calls and hits
    # what rollout 0 recorded after its timeout; rollout 0 also repeats its own last call.
    first = [
        sample(0, 0, "a", cached=False),
        sample(0, 1, "b", cached=False, result={"timed_out": True}),
        sample(0, 2, "c", cached=False),
        sample(0, 3, "c", cached=True),
    ]
    second = [sample(1, 0, "a", cached=True), sample(1, 1, "b", cached=False), sample(1, 2, "c", cached=True)]
    for rollout in (first, second):
        mark_unknown_state(rollout)
    oracle = issued_oracle([EpochRun("client", 0, calls=first + second)])
    # The rule's oracle: rollout 1's "a" and rollout 0's own repeat of "c"; without the rule also
    # rollout 1's "c" (what rollout 0 issued off the shared graph). Neither lets anyone hit the
    # timed-out "b".
    assert oracle.hits == {0: 2} and oracle.no_rule_hits == {0: 3}
    assert oracle.forbidden == {0: 1}  # rollout 1's hit on "c"
    assert oracle.forbidden_examples == [
        {"epoch": 0, "task": "t", "rollout": 1, "position": 2, "tool": "bash", "after_unknown_state": False}
    ]


def test_divergences_are_read_in_whatever_shape_the_stats_give_them():
    assert divergence_count({}) is None
    assert divergence_count({"divergences": 4}) == {"count": 4}
    assert divergence_count({"divergences": [{"node": 1}, {"node": 2}]}) == {"count": 2}
    stats = {
        "divergences": {
            "count": 3,
            "divergent_nodes": 2,
            "per_tool": [{"tool": "bash", "audit": 1, "state": 1}, {"tool": "cat", "audit": 0, "state": 1}],
        }
    }
    assert divergence_count(stats) == {"count": 3, "divergent_nodes": 2, "audit": 1, "state": 2}
