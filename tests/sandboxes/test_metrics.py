"""Tool-server mode on the real Docker engine and a real Celery worker, seen from /metrics: call
latency by tool and cached, the critical-path start, the snapshot's commit, the worker's pre-fork
(another thread, the same files), and the live sandboxes and snapshots read at scrape time."""

from __future__ import annotations

import pytest

from cache.models import Snapshot
from sandboxes.models import Sandbox
from tests.support.metrics import scrape
from tests.support.toolserver import bash, run

from .test_workers import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def test_tool_server_calls_forks_and_commits_are_measured(api, docker_task, celery_worker):
    task = docker_task("metrics")
    setup = bash("sleep 1; echo built > /artifact")  # slow: snapshotted, and pre-forked by the worker
    before = scrape(api)
    assert run(api, task, "r1", setup)["cached"] is False
    snapshot = Snapshot.objects.get(task_id=task, status="live")
    wait_for(lambda: Sandbox.objects.filter(snapshot=snapshot, state="ready").exists())
    assert run(api, task, "r2", setup)["cached"] is True
    after = scrape(api)

    def delta(name: str, **labels) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    assert delta("tvcache_tool_call_seconds_count", tool="bash", cached="false") == 1
    assert delta("tvcache_tool_call_seconds_count", tool="bash", cached="true") == 1
    assert delta("tvcache_tool_call_seconds_sum", tool="bash", cached="false") >= 1.0  # it slept a second
    assert delta("tvcache_sandbox_start_seconds_count", backend="docker", origin="root", path="critical") == 1
    assert delta("tvcache_sandbox_start_seconds_count", backend="docker", origin="snapshot", path="pool") == 1
    assert delta("tvcache_snapshot_commit_seconds_count", backend="docker") == 1
    assert delta("tvcache_lookups_total", project="default", tool="bash", result="hit") == 1
    assert after.value("tvcache_snapshots", backend="docker", owner="service") == 1
    assert after.value("tvcache_sandboxes", backend="docker", pool="root", state="leased") == 1
    assert after.value("tvcache_sandboxes", backend="docker", pool="fork", state="ready") == 1
