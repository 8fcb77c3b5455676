"""The report's miss-phase, verification and verify-step figures, on samples made by hand: what
they count, as report.py defines them (the replay tests check them on live runs)."""

from lab.replay.report import arm_summary, issued_oracle
from lab.replay.samples import CallSample, EpochRun
from lab.replay.workload import VERIFY_STEP


def sample(
    rollout: int,
    position: int,
    latency_ms: float,
    cached: bool | None,
    *,
    step: str | None = None,
    phases: dict[str, float] | None = None,
    epoch: int = 0,
) -> CallSample:
    out = CallSample("t", epoch, rollout, position, "bash", latency_ms, cached, None, "digest")
    out.step, out.phases_ms = step, phases
    return out


def summary(calls: list[CallSample]) -> dict:
    runs = [EpochRun("server", 0, calls=calls)]
    return arm_summary(runs, issued_oracle(runs))


def test_miss_phases_and_the_cost_of_verification():
    a = summary(
        [
            sample(0, 0, 100, False, phases={"lookup": 2, "exec": 80, "verify": 6, "fingerprint": 4}),
            sample(0, 1, 5, True),  # a hit has no phases
            sample(0, 2, 60, False, phases={"lookup": 2, "exec": 50, "fingerprint": 2}),
            sample(
                1, 0, 200, False, phases={"lookup": 2, "materialize": 60, "exec": 100, "verify": 10, "fingerprint": 10}
            ),
        ]
    )
    phases, verification = a["miss_phases_ms"], a["verification"]
    # A miss that did not go through a phase counts 0 ms in it.
    assert phases["verify"] == {"p50": 6, "p95": 10, "mean": 5.333, "total_s": 0.016, "misses": 2}
    assert phases["snapshot"]["misses"] == 0 and phases["snapshot"]["total_s"] == 0
    # The latency outside the phases: 100 - 92, 60 - 54, 200 - 182.
    assert phases["other"] == {"p50": 8, "p95": 18, "mean": 10.667, "total_s": 0.032, "misses": 3}
    # Medians over the misses: latency 100; verify + fingerprint 10 (of 10, 2, 20); latency less it 90 (of 90, 56, 180).
    assert verification == {
        "misses": 3,
        "median_miss_ms": 100,
        "median_verification_ms": 10,
        "median_miss_unverified_ms": 90,
        "share_pct": 10.0,
        "cost_pct": 11.11,
    }


def test_verify_step_and_the_final_verification_of_each_rollout():
    a = summary(
        [
            sample(0, 0, 50, False),
            sample(0, 1, 30, False, step=VERIFY_STEP),
            sample(0, 2, 9, False),
            sample(0, 3, 20, True, step=VERIFY_STEP),
            sample(0, 4, 2, True),  # rollout 0's final verification: position 3
            sample(1, 0, 40, False, step=VERIFY_STEP),
            sample(1, 1, 1, True),  # rollout 1's: position 0
            sample(0, 0, 70, False, step=VERIFY_STEP, epoch=1),  # the same rollout index, another epoch
        ]
    )
    assert a["verify_step"] == {"calls": 4, "hits": 1, "tool_time_s": 0.16}
    assert a["final_verify"] == {"calls": 3, "hits": 1, "tool_time_s": 0.13}
    assert "miss_phases_ms" not in a  # no miss the service answered with phases


def test_no_step_labels_no_step_figures():
    assert not {"verify_step", "final_verify"} & set(summary([sample(0, 0, 5, None)]))


def _keyed(rollout: int, started: float, latency_ms: float, cached: bool, *, unshared: bool = False) -> CallSample:
    out = sample(rollout, 0, latency_ms, cached)
    out.started, out.key, out.unshared = started, ("state", "call"), unshared
    return out


def test_a_hit_that_waited_for_another_rollouts_run_is_not_forbidden():
    # Rollout 2, off the shared graph, issued the call first; rollout 0 sent it next but waited
    # (single flight) for rollout 1's run of it, which it was answered from: not a forbidden hit.
    detached = _keyed(2, 0.0, 10, False, unshared=True)
    waiter, leader = _keyed(0, 1.0, 300, True), _keyed(1, 1.01, 250, False)
    assert issued_oracle([EpochRun("client", 0, calls=[detached, waiter, leader])]).forbidden == {0: 0}
    # Answered before any rollout on the shared graph issued the call: only the detached one's
    # run can have given it.
    early = _keyed(0, 1.0, 5, True)
    assert issued_oracle([EpochRun("client", 0, calls=[detached, early, _keyed(1, 1.5, 250, False)])]).forbidden == {
        0: 1
    }


def test_matching_by_state_holds_the_hit_rate_to_the_state_oracle():
    """A run whose tasks match by state is held to the state oracle and shown above the
    longest-prefix one; the same figures matching by history miss the target."""
    from lab.replay.report import targets

    exact = {"hits_checked": 10, "hits_mismatches": 0, "misses_checked": 5, "misses_mismatches": 0}
    server = {
        "exact": exact,
        "service_hit_rate": 0.73,
        "oracle_hit_rate": 0.70,
        "state_oracle_hit_rate": 0.73,
        "issued_oracle_hit_rate": 0.70,
    }
    by_state = targets("sql", {"server": server}, "state")
    assert (
        by_state["hit_rate_equals_oracle"]["met"]
        and by_state["hit_rate_equals_oracle"]["oracle"] == "state_oracle_hit_rate"
    )
    assert by_state["hit_rate_above_longest_prefix_oracle"] == {"server": 3.0}
    by_history = targets("sql", {"server": server}, "history")
    assert not by_history["hit_rate_equals_oracle"]["met"] and "hit_rate_above_longest_prefix_oracle" not in by_history
