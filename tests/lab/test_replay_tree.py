"""The tree replay (`manage.py replay_tree`) in a tiny configuration against a live service (uvicorn
and a Celery worker in subprocesses on the test database): every trajectory of the trees ran in
every arm, the branches were opened as planned (server: POST .../branches, client:
ToolCallExecutor.branch), no answer differs from a fresh execution of its own full history, and the
report has the tree's figures. Tests of the harness and of branching, not of timings."""

from __future__ import annotations

import json

import docker
import pytest
from django.conf import settings
from django.core.management import call_command

from accounts.services.tokens import token_create
from cache.models import Task
from lab.server import service_running
from sandboxes.services import tasks_release

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

ARMS = ["nocache", "server", "client"]
MATERIALIZED = {"prefork", "fork", "checkpoint", "root", "own", "rebuilt", "on_miss"}


@pytest.fixture
def service(tmp_path):
    with service_running(
        db=settings.DATABASES["default"], redis_url=settings.REDIS_URL, celery=True, beat=True, log_dir=tmp_path
    ) as service:
        yield service.url, token_create(name="replay-tree")
        # The command got --url, so it leaves the service's sandboxes to the service: stop them here.
        tasks_release(task_ids=list(Task.objects.values_list("pk", flat=True)))


def replay_tree(service, tmp_path, blocker, **options) -> dict:
    url, token = service
    out = tmp_path / "out"
    # With --url the replay talks to the service over HTTP only: a query on this process's
    # database, from any of its threads, fails the run.
    with blocker.block():
        call_command(
            "replay_tree", url=url, token=token, epochs=1, out=str(out), seed=3, think_ms=10, no_plots=True, **options
        )
    [report] = out.glob("*-tree-*.json")
    return json.loads(report.read_text())


def check(report: dict, workload: str, *, roots: int, count: int, depth: int, hits: bool) -> None:
    """`hits`: the trees repeat calls, so the cached arms must hit."""
    assert report["replay"] == "tree" and report["workload"] == workload
    assert [arm["name"] for arm in report["arms"]] == ARMS
    tree = report["tree"]
    assert tree["shape"]["count"] == count and tree["shape"]["depth"] == depth
    levels = {str(level): roots * count**level for level in range(depth + 1)}
    branches = sum(levels.values()) - roots
    calls = tree["arms"]["nocache"]["structure"]["calls"]
    for name in ARMS:
        arm = tree["arms"][name]
        structure = arm["structure"]
        # The same trees in every arm, every trajectory run, every branch point opened.
        assert structure["by_level"] == levels, (name, structure, arm["branch_error_examples"])
        assert structure["branches"] == branches and structure["branch_points"] == branches // count
        assert structure["branch_errors"] == 0 and structure["calls"] == calls > 0, arm["branch_error_examples"]
        # What a user would notice: no answer differs from a fresh execution of the branch's history.
        assert arm["wrong_answers"] == 0, report["mismatch_examples"]
        readiness = arm["readiness_ms"]
        assert readiness["ready"]["n"] == readiness["first_call"]["n"] == readiness["first_answer"]["n"] == branches
        assert 0 <= readiness["ready"]["p50"] <= readiness["ready"]["p95"]
        throughput = arm["throughput"]
        assert throughput["trajectories"] == sum(levels.values()) and throughput["sandbox_s"] > 0
        assert throughput["trajectories_per_sandbox_s"] > 0 and throughput["trajectories_per_tool_s"] > 0
        assert throughput["sandbox_s_measured"] == ("sampled" if name == "server" else "lifetimes")
    for name in ("server", "client"):
        arm = tree["arms"][name]
        # Every answer was judged.
        assert arm["exact"]["hits_checked"] + arm["exact"]["misses_checked"] == calls
        assert arm["hit_rate"] > 0 or not hits
        assert arm["readiness_ms"]["request"]["n"] == branches // count
        assert report["summary"][name]["exact"]["hits_mismatches"] == 0
        assert set(tree["comparison"][name]) >= {"trajectories_per_sandbox_s_x", "ready_p50_speedup_x"}
        assert tree["comparison"][name]["same_trees"]
    server = tree["arms"]["server"]
    # Each branch starts with its origin's history, and the service made each one a sandbox.
    assert server["history_mismatches"] == 0, server["history_mismatch_examples"]
    # (Those made before the answer say how long they took; pre-forks warm after it.)
    assert server["readiness_ms"]["service_ready"]["n"] == branches - server["materialized"].get("on_miss", 0)
    assert set(server["materialized"]) <= MATERIALIZED and sum(server["materialized"].values()) == branches
    assert sum(b["arms"]["server"]["branches"] for b in tree["by_step"]) == branches
    assert [e["epoch"] for e in tree["epochs"]] == [0] and set(tree["epochs"][0]["arms"]) == set(ARMS)
    assert report["targets"]["zero_mismatched_hits"]["met"] and report["targets"]["zero_mismatched_misses"]["met"]


def test_replay_tree_sql(service, tmp_path, django_db_blocker):
    report = replay_tree(
        service,
        tmp_path,
        django_db_blocker,
        workload="sql",
        tasks=1,
        rollouts=2,
        branch_count=2,
        branch_depth=2,
        latency_ms=5,
        rows=300,
    )
    check(report, "sql", roots=2, count=2, depth=2, hits=True)
    # Read-only queries: every branch starts at the task's root state.
    assert {b["k"] for b in report["tree"]["by_step"]} == {"0-3"}


def test_replay_tree_terminal(service, tmp_path, django_db_blocker):
    docker.from_env().images.get("tvcache/debian:bookworm")  # a missing image fails the test
    # After the setup (5 calls): the branches start where the repair loop does.
    report = replay_tree(
        service,
        tmp_path,
        django_db_blocker,
        workload="terminal",
        task_names="config-edit",
        rollouts=1,
        branch_count=2,
        branch_depth=1,
        branch_at="5",
        step_bucket=1,
    )
    # Continuations unlike each other, from one root in one epoch: they may repeat nothing.
    check(report, "terminal", roots=1, count=2, depth=1, hits=False)
    # The service's step counts the setup's state-changing calls: its 4 writes, and its check if the
    # service saw it change the sandbox.
    [k] = {b["k"] for b in report["tree"]["by_step"]}
    assert k in {"4-4", "5-5"}
