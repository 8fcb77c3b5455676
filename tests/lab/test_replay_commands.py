"""The replay commands, each in a tiny configuration against a live service (uvicorn and a Celery
worker in subprocesses on the test database): the report has its fields, no hit differs from a
fresh execution of its history, and the second epoch hits. Tests of the harness, not of timings."""

from __future__ import annotations

import json

import docker
import pytest
from django.conf import settings
from django.core.management import call_command

from accounts.services.tokens import token_create
from cache.models import Task
from lab.replay.report import PHASES
from lab.server import service_running
from sandboxes.services import tasks_release

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

EPOCH_FIELDS = {
    "calls",
    "hits",
    "hit_rate",
    "latency_ms",
    "step_s",
    "slowest_rollout_s",
    "rollout_s",
    "sandboxes",
    "exact",
    "tool_time_s",
}


@pytest.fixture
def service(tmp_path):
    with service_running(
        db=settings.DATABASES["default"], redis_url=settings.REDIS_URL, celery=True, beat=True, log_dir=tmp_path
    ) as service:
        yield service.url, token_create(name="replay")
        # The command got --url, so it leaves the service's sandboxes to the service: stop them here.
        tasks_release(task_ids=list(Task.objects.values_list("pk", flat=True)))


def replay(command: str, service, tmp_path, blocker, **options) -> dict:
    url, token = service
    out = tmp_path / "out"
    # With --url the replay talks to the service over HTTP only: a query on this process's
    # database, from any of its threads, fails the run.
    with blocker.block():
        call_command(command, url=url, token=token, rollouts=2, epochs=2, out=str(out), seed=3, think_ms=10, **options)
    [report] = out.glob("*.json")
    return json.loads(report.read_text())


def check(report: dict, workload: str, cached_arms: list[str], plots: bool = False) -> None:
    assert report["workload"] == workload
    assert [arm["name"] for arm in report["arms"]] == ["nocache", *cached_arms]
    assert [epoch["epoch"] for epoch in report["epochs"]] == [0, 1]
    for epoch in report["epochs"]:
        for name in ["nocache", *cached_arms]:
            assert EPOCH_FIELDS <= set(epoch["arms"][name])
            assert {"p50", "p95"} <= set(epoch["arms"][name]["latency_ms"])
        for name in cached_arms:
            metrics = epoch["arms"][name]
            assert {"service_hit_rate", "oracle_hit_rate", "service"} <= set(metrics)
            # The harness's own oracle counts every repeat of a history the service's does, and
            # concurrent repeats too: it bounds the hits by history from above (a state-keyed hit
            # repeats a state reached by another history; the service's state oracle counts it).
            service = metrics["service"]
            by_history = metrics["service_hit_rate"] - service.get("state_hits", 0) / service["calls"]
            assert metrics["issued_oracle_hit_rate"] >= by_history - 1e-9
            assert metrics["service_hit_rate"] <= service["state_oracle_hit_rate"] + 1e-9
            assert metrics["calls"] == epoch["arms"]["nocache"]["calls"] > 0
            assert metrics["exact"]["hits_checked"] == metrics["hits"]
            assert metrics["exact"]["hits_mismatches"] == 0, report["mismatch_examples"]
            # The tools are deterministic: a miss also answers what a fresh execution does.
            assert metrics["exact"]["misses_mismatches"] == 0, report["mismatch_examples"]
    assert report["config"]["think_ms"] == 10
    for name in cached_arms:
        assert report["epochs"][1]["arms"][name]["service_hit_rate"] > 0
        assert report["summary"][name]["exact"]["hits_mismatches"] == 0
    assert report["targets"]["zero_mismatched_hits"]["met"]
    assert report["targets"]["hit_rate_equals_oracle"]["met"]  # no budget: the cache reaches the oracle
    assert report["per_tool"].keys() == set(cached_arms)
    if "client" in cached_arms:  # a miss's lookup as the rollout saw it, and the service's share (Server-Timing)
        lookups, served = (
            report["summary"]["client"]["miss_lookup_ms"],
            report["summary"]["client"]["miss_lookup_server_ms"],
        )
        assert lookups["n"] == served["n"] > 0 and 0 < served["p50"] <= lookups["p50"]
        # and the part of its overhead spent waiting for the previous miss's record and snapshot
        waits, overheads = (
            report["summary"]["client"]["miss_background_wait_ms"],
            report["summary"]["client"]["miss_overhead_ms"],
        )
        assert waits["n"] == overheads["n"] and 0 <= waits["mean"] <= overheads["mean"]
    for name in cached_arms:
        summary = report["summary"][name]
        if name.startswith("server"):  # where each miss's time went, as the service answered it
            check_miss_phases(summary)
        else:  # client mode: the service runs none of the calls
            assert "miss_phases_ms" not in summary and "verification" not in summary
    if plots:
        assert len(report["plots"]) == 4
        for path in report["plots"]:
            with open(path, "rb") as png:
                assert png.read(8) == b"\x89PNG\r\n\x1a\n"


def check_miss_phases(summary: dict) -> None:
    phases, verification = summary["miss_phases_ms"], summary["verification"]
    misses = summary["calls"] - summary["hits"]  # no faults: the service answered every call
    assert list(phases) == [*PHASES, "other"] and verification["misses"] == misses > 0
    # Every miss is looked up and executed, and its new state fingerprinted or not.
    assert phases["lookup"]["misses"] == phases["exec"]["misses"] == phases["other"]["misses"] == misses
    assert all(0 <= f["p50"] <= f["p95"] and f["total_s"] >= 0 and f["misses"] <= misses for f in phases.values())
    assert phases["exec"]["p50"] > 0 and phases["exec"]["total_s"] > 0
    assert 0 < verification["median_miss_unverified_ms"] <= verification["median_miss_ms"]
    assert verification["cost_pct"] >= 0 and 0 <= verification["share_pct"] < 100


def test_replay_sql(service, tmp_path, django_db_blocker):
    report = replay("replay_sql", service, tmp_path, django_db_blocker, tasks=1, latency_ms=5, rows=300)
    check(report, "sql", ["client", "server"], plots=True)
    # The sql workload names no steps.
    assert not any("verify_step" in a or "final_verify" in a for a in report["summary"].values())


def test_replay_bfcl(service, tmp_path, django_db_blocker):
    report = replay("replay_bfcl", service, tmp_path, django_db_blocker, tasks=2, no_plots=True)
    check(report, "bfcl", ["client"])
    assert "GorillaFileSystem.ls" in report["workload_info"]["read_only_tools"]


def test_replay_terminal(service, tmp_path, django_db_blocker):
    docker.from_env().images.get("tvcache/debian:bookworm")  # a missing image fails the test
    # The lab's own containers (no cache, client mode) run calls through the session agent here;
    # the fault arm's test below runs them by docker exec, the default.
    report = replay(
        "replay_terminal",
        service,
        tmp_path,
        django_db_blocker,
        task_names="config-edit",
        arms="server,client",
        no_plots=True,
        direct_calls="session",
    )
    check(report, "terminal", ["server", "client"])
    assert report["workload_info"]["direct_calls"] == "session"
    assert report["epochs"][0]["arms"]["server"]["sandboxes"]["starts"] > 0
    # Docker misses that change the state fingerprint it.
    assert report["summary"]["server"]["miss_phases_ms"]["fingerprint"]["misses"] > 0
    assert "verification_cost" in report["targets"]
    # The runs of the task's verifier, the same calls in every arm: every rollout ends its repair
    # loop with one, the final verification (2 rollouts x 2 epochs).
    steps = {name: (a["verify_step"], a["final_verify"]) for name, a in report["summary"].items()}
    assert {(step["calls"], final["calls"]) for step, final in steps.values()} == {(steps["nocache"][0]["calls"], 4)}
    assert steps["nocache"][0]["hits"] == steps["nocache"][1]["hits"] == 0
    for step, final in steps.values():
        assert step["calls"] >= final["calls"] and step["hits"] >= final["hits"]
        assert step["tool_time_s"] >= final["tool_time_s"] > 0


# The fault arm (--faults): the command starts its own service, so that it can restart it.


def replay_with_faults(command: str, tmp_path, **options) -> dict:
    out = tmp_path / "out"
    call_command(
        command,
        **{
            "rollouts": 3,
            "epochs": 2,
            "out": str(out),
            "seed": 3,
            "think_ms": 10,
            "faults": True,
            "fault_rate": 1.0,
            "no_plots": True,
            **options,
        },
    )
    [report] = out.glob("*.json")
    return json.loads(report.read_text())


def check_faults(report: dict, cached_arms: list[str], kinds: dict[str, set[str]]) -> None:
    faults = report["faults"]
    assert report["config"]["faults"] and faults["plan"]["rate"] == 1.0
    # One restart per cached arm, in the middle epoch, while its rollouts were in flight.
    assert sorted(r["arm"] for r in faults["restarts"]) == sorted(cached_arms)
    assert all(r["epoch"] == 1 and "error" not in r for r in faults["restarts"]), faults["restarts"]
    for name in cached_arms:
        arm = faults["arms"][name]
        assert set(arm["planned"]) <= kinds[name] and set(arm["fired"]) <= kinds[name] | {"timeout"}, arm
        if kinds[name]:  # every rollout gets one (rate 1); it fires when its call runs in the rollout's sandbox
            assert sum(arm["planned"].values()) > 0 and sum(arm["fired"].values()) > 0, arm
            assert arm["calls_after_unknown_state"] > 0, arm
        # Requests the restart cut off were sent again: by tvclient itself within its retry budget,
        # or by the harness past it; none failed.
        restart = next(r for r in faults["restarts"] if r["arm"] == name)
        assert arm["retried_calls"] + restart["client_retried_requests"] > 0 and arm["failed_calls"] == 0, (
            arm,
            restart,
        )
        # The known-state rule only takes hits away.
        assert arm["no_fault_oracle_hit_rate"] >= arm["issued_oracle_hit_rate"]
        assert arm["cost_points"]["known_state_rule"] >= 0
        assert arm["divergences"] is None or arm["divergences"].get("count", 0) >= 0
    for name in cached_arms:  # what a user would notice: no answer differs from a fresh execution
        arm = faults["arms"][name]
        assert (arm["wrong_hits"], arm["wrong_misses"], arm["forbidden_hits"], arm["timed_out_hits"]) == (0, 0, 0, 0), (
            name,
            arm,
            report["mismatch_examples"],
        )


def test_replay_sql_faults(tmp_path):
    report = replay_with_faults("replay_sql", tmp_path, tasks=2, latency_ms=5, rows=300)
    check_faults(report, ["client", "server"], {"client": {"error_after", "timeout_after"}, "server": set()})


def test_replay_bfcl_faults(tmp_path):
    report = replay_with_faults("replay_bfcl", tmp_path, tasks=2)
    check_faults(report, ["client"], {"client": {"error_after", "timeout_after"}})


def test_replay_terminal_faults(tmp_path):
    docker.from_env().images.get("tvcache/debian:bookworm")  # a missing image fails the test
    # Seed 9: every kind among the 6 rollouts (timeouts, environment errors, sandbox deaths).
    report = replay_with_faults("replay_terminal", tmp_path, task_names="config-edit", arms="server,client", seed=9)
    check_faults(
        report, ["server", "client"], {"server": {"timeout", "sandbox_death"}, "client": {"timeout", "error_after"}}
    )
    # The containers of the rollouts were removed, and the timed-out calls killed, the fresh executions' too.
    assert set(report["faults"]["arms"]["server"]["fired"]) == {"timeout", "sandbox_death"}
