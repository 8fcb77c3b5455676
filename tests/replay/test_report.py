"""The replay report's miss-time breakdown, from samples as the harness keeps them."""

from cache.replay.harness import CallSample, EpochRun
from cache.replay.report import headline, miss_phases


def sample(latency_ms: float, cached: bool | None, phases: dict[str, float] | None) -> CallSample:
    return CallSample("t", 0, 0, 0, "bash", latency_ms, cached, None, "", phases_ms=phases)


def test_miss_time_is_broken_down_by_phase_with_the_rest_as_other():
    run = EpochRun("server", 0, calls=[
        sample(100.0, False, {"lookup": 2.0, "exec": 80.0, "record": 8.0}),
        sample(50.0, False, {"lookup": 4.0, "materialize": 30.0, "exec": 10.0, "record": 4.0}),
        sample(3.0, True, {"lookup": 2.0}),  # a hit: not a miss's time
        sample(40.0, None, None),  # the nocache arm keeps no phases
    ])
    breakdown = miss_phases([run])
    assert (breakdown["misses"], breakdown["miss_time_s"]) == (2, 0.15)
    phases = breakdown["phases"]
    assert list(phases) == ["lookup", "materialize", "exec", "record", "other"]  # in the order they run
    assert (phases["materialize"]["n"], phases["materialize"]["p50"]) == (1, 30.0)
    assert phases["exec"]["share"] == round(90 / 150, 4)
    assert (phases["other"]["n"], phases["other"]["p95"], phases["other"]["share"]) == (2, 10.0, round(12 / 150, 4))


def test_no_misses_no_breakdown_and_the_headline_shows_it_per_arm():
    assert miss_phases([EpochRun("server", 0, calls=[sample(3.0, True, {"lookup": 2.0})])]) == {}
    run = EpochRun("server", 0, calls=[sample(10.0, False, {"exec": 9.0})])
    report = {"epochs": [], "summary": {"server": {"miss_phases": miss_phases([run])}, "nocache": {}}}
    table = headline(report)
    assert "| server | exec | 1 | 9.0 | 9.0 | 90.0 % |" in table and "| server | other | 1 |" in table
