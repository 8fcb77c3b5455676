"""Tool-server mode against the real Docker engine (and the folder and SQLite backends)."""

from __future__ import annotations

import docker
import pytest

from sandboxes.models import Sandbox
from tests.support.toolserver import bash, run

pytestmark = pytest.mark.django_db(transaction=True)


def test_stale_read_after_a_write_is_executed_again(api, docker_task):
    task = docker_task("stale")
    assert run(api, task, "r1", bash("echo one > f"))["cached"] is False
    assert run(api, task, "r1", bash("cat f"))["result"]["stdout"] == "one\n"
    assert run(api, task, "r2", bash("echo one > f"))["cached"] is True
    assert run(api, task, "r2", bash("cat f"))["cached"] is True
    run(api, task, "r2", bash("echo two > f"))
    again = run(api, task, "r2", bash("cat f"))
    assert (again["cached"], again["result"]["stdout"]) == (False, "two\n")


def test_calls_that_change_nothing_leave_the_history_and_later_calls_match_without_them(api, docker_task):
    task = docker_task("observed")
    setup, append = bash("mkdir -p /w && echo a > /w/f"), bash("echo b >> /w/f")
    assert run(api, task, "r1", setup)["mutates"] is True
    assert run(api, task, "r1", bash("ls /w"))["mutates"] is False  # observed: nothing changed
    assert run(api, task, "r1", append)["mutates"] is True
    assert run(api, task, "r1", bash("cat /w/f"))["result"]["stdout"] == "a\nb\n"
    # r2 skips the inspection: its append and read are r1's, from the cache.
    run(api, task, "r2", setup)
    assert run(api, task, "r2", append)["cached"] is True
    assert run(api, task, "r2", bash("cat /w/f"))["cached"] is True
    # r3 inspects differently before the append: executed (in a sandbox at r1's setup), read-only.
    run(api, task, "r3", setup)
    read = run(api, task, "r3", bash("cat /w/f"))
    assert (read["cached"], read["mutates"], read["result"]["stdout"]) == (False, False, "a\n")
    assert run(api, task, "r3", append)["cached"] is True
    # r3's sandbox is behind by the cached append; its next miss sees the state its history says.
    fresh = run(api, task, "r3", bash("wc -l < /w/f"))
    assert (fresh["cached"], fresh["result"]["stdout"]) == (False, "2\n")
    # A rewrite with the same content is a write: the read after it is not r1's.
    run(api, task, "r2", bash("echo a > /w/f"))
    assert run(api, task, "r2", bash("cat /w/f"))["result"]["stdout"] == "a\n"


def test_hits_need_no_sandbox(api, docker_task):
    task = docker_task("nosandbox")
    run(api, task, "r1", bash("echo hi"))
    run(api, task, "r2", bash("echo hi"))
    assert Sandbox.objects.filter(rollout__rollout_id="r2").count() == 0


def test_cwd_and_exports_survive_calls_and_forks(api, docker_task, snapshot_every_call):
    task = docker_task("session")
    setup = bash("mkdir -p /work && cd /work && export GREETING='hello there'")  # snapshotted
    run(api, task, "r1", setup)
    assert run(api, task, "r1", bash('echo "$PWD $GREETING"'))["result"]["stdout"] == "/work hello there\n"
    run(api, task, "r2", setup)  # a hit: r2 has no sandbox yet
    forked = run(api, task, "r2", bash('echo "$GREETING in $PWD"'))
    assert forked["result"]["stdout"] == "hello there in /work\n"
    assert Sandbox.objects.get(rollout__rollout_id="r2", state="leased").pool == "fork"


def test_resume_from_a_mid_path_snapshot_replays_only_the_suffix(api, docker_task):
    task = docker_task("suffix")
    random_id = bash("sleep 1; cat /proc/sys/kernel/random/uuid > /id")  # slow: a snapshot after it
    append = bash("echo b >> /log")  # cheap: replayed, not snapshotted
    run(api, task, "r1", random_id)
    run(api, task, "r1", append)
    original = run(api, task, "r1", bash("cat /id"))["result"]["stdout"]
    run(api, task, "r2", random_id)
    run(api, task, "r2", append)
    state = run(api, task, "r2", bash("cat /id; cat /log"))
    assert state["cached"] is False
    # Forked from the snapshot (same random id) and `echo b` replayed exactly once on top.
    assert state["result"]["stdout"] == original + "b\n"


def test_two_tasks_never_see_each_others_files(api, docker_task):
    docker_task("task-a")
    docker_task("task-b", env={"backend": "docker", "limits": {"memory_mb": 256}})
    run(api, "task-a", "r", bash("echo secret > /secret"))
    other = run(api, "task-b", "r", bash("cat /secret"))
    assert other["result"]["exit_code"] != 0 and "secret" not in other["result"]["stdout"]


def test_sandboxes_have_no_network_and_limits(api, docker_task, busybox):
    task = docker_task("limits")
    run(api, task, "r", bash("true"))
    row = Sandbox.objects.get(rollout__rollout_id="r")
    host = busybox.api.inspect_container(row.ref)["HostConfig"]
    assert host["NetworkMode"] == "none" and not host["Privileged"] and host["Memory"] > 0 and host["PidsLimit"] > 0
    assert not host.get("Binds")


def test_unknown_tool_is_a_clear_400(api, docker_task):
    task = docker_task("unknown")
    response = api.post(f"/api/v1/tasks/{task}/rollouts/r/calls", {"call": {"tool": "rm", "args": {}}}, format="json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "unknown_tool"


def test_timeout_is_flagged_and_not_cached(api, docker_task):
    task = docker_task("timeout")
    first = run(api, task, "r1", bash("sleep 5", timeout_s=1))
    assert first["result"]["timed_out"] is True and first["node_id"] is None
    assert run(api, task, "r2", bash("sleep 5", timeout_s=1))["cached"] is False


def test_output_over_the_cap_is_truncated_with_a_flag(api, docker_task):
    task = docker_task("flood")
    result = run(api, task, "r", bash("head -c 200000 /dev/zero | tr '\\0' x"))["result"]
    assert result["truncated"] is True and len(result["stdout"]) < 200_000


def test_sandbox_dying_mid_call_is_a_clear_error_and_the_rollout_goes_on(api, docker_task, busybox):
    task = docker_task("dies")
    run(api, task, "r", bash("echo 1 > /state"))
    row = Sandbox.objects.get(rollout__rollout_id="r", state="leased")
    busybox.api.kill(row.ref)
    response = api.post(f"/api/v1/tasks/{task}/rollouts/r/calls", {"call": bash("cat /state")}, format="json")
    assert response.status_code == 503 and response.json()["error"]["code"] == "sandbox_gone"
    again = run(api, task, "r", bash("cat /state"))  # re-materialized: fresh root + replay
    assert again["result"]["stdout"] == "1\n"


def test_ending_a_rollout_frees_its_sandbox(api, docker_task, busybox):
    task = docker_task("end")
    run(api, task, "r", bash("true"))
    ref = Sandbox.objects.get(rollout__rollout_id="r").ref
    assert api.delete(f"/api/v1/tasks/{task}/rollouts/r").status_code == 204
    with pytest.raises(docker.errors.NotFound):
        busybox.api.inspect_container(ref)
    assert run(api, task, "r", bash("true"), status=409)["error"]["code"] == "rollout_finished"


def test_directory_and_sqlite_tasks_run_in_tool_server_mode(api):
    api.put("/api/v1/tasks/files", {"env": {"backend": "directory", "files": {"a.txt": "A"}}}, format="json")
    assert run(api, "files", "r", {"tool": "read_file", "args": {"path": "a.txt"}})["result"] == {
        "output": "A",
        "ok": True,
    }
    api.put("/api/v1/tasks/db", {"env": {"backend": "sqlite", "schema_sql": "create table t (x int);"}}, format="json")
    run(api, "db", "r", {"tool": "execute", "args": {"sql": "insert into t values (7)"}})
    rows = run(api, "db", "r", {"tool": "query", "args": {"sql": "select x from t"}})["result"]["rows"]
    assert rows == [[7]]


def test_a_directory_write_that_changed_nothing_leaves_the_history(api):
    api.put("/api/v1/tasks/files-observed", {"env": {"backend": "directory", "files": {"a.txt": "A"}}}, format="json")
    task = "files-observed"
    rewrite = {"tool": "write_file", "args": {"path": "a.txt", "content": "A"}}
    read = {"tool": "read_file", "args": {"path": "a.txt"}}
    assert run(api, task, "r1", rewrite)["mutates"] is False  # the content the file held
    assert run(api, task, "r1", read)["result"]["output"] == "A"
    # r2 never rewrote the file: its read is r1's, from the cache.
    assert run(api, task, "r2", read)["cached"] is True
    assert run(api, task, "r2", {"tool": "write_file", "args": {"path": "a.txt", "content": "B"}})["mutates"] is True
    after = run(api, task, "r2", read)
    assert (after["cached"], after["result"]["output"]) == (False, "B")


def test_external_tasks_are_not_served_in_tool_server_mode(api, toy_task):
    assert run(api, toy_task, "r", {"tool": "read", "args": {}}, status=400)["error"]["code"] == "not_managed"


def test_a_second_call_of_a_busy_rollout_is_refused_and_the_history_stays_exact(api, docker_task):
    import threading

    from django.db import connection

    task = docker_task("busy")
    outcome = {}

    def slow():
        try:
            outcome["slow"] = run(api, task, "r", bash("sleep 4; echo 1 >> /f"))
        finally:
            connection.close()

    worker = threading.Thread(target=slow)
    worker.start()
    while not Sandbox.objects.filter(rollout__rollout_id="r", state="leased").exists():
        assert worker.is_alive()
        threading.Event().wait(0.1)
    assert run(api, task, "r", bash("echo 2 >> /f"), status=409)["error"]["code"] == "rollout_busy"
    worker.join()
    assert run(api, task, "r", bash("cat /f"))["result"]["stdout"] == "1\n"


def test_every_lease_a_miss_takes_is_released(api, docker_task, snapshot_every_call):
    from cache.models import Lease

    task = docker_task("leases")
    setup = bash("echo s > /s")  # snapshotted
    run(api, task, "r1", setup)
    run(api, task, "r2", setup)
    for command in ("echo 1", "echo 2", "echo 3"):  # misses below a snapshot
        run(api, task, "r2", bash(command))
    # Only the first leases it (r2 forks it); then r2 has a sandbox of its own and leases nothing.
    assert Lease.objects.count() == 1
    assert not Lease.objects.filter(released_at__isnull=True).exists()


def test_rollouts_missing_on_the_same_call_at_once_execute_it_once(api, token, docker_task):
    import threading

    from django.db import connection
    from rest_framework.test import APIClient

    task = docker_task("flight")
    draw = bash("sleep 2; cat /proc/sys/kernel/random/uuid")  # a different answer each time it runs
    outcomes = {}

    def call(rollout: str) -> None:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
        try:
            outcomes[rollout] = run(client, task, rollout, draw)
        finally:
            connection.close()

    threads = [threading.Thread(target=call, args=(f"r{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(o["cached"] for o in outcomes.values()) == [False, True, True]
    assert len({o["result"]["stdout"] for o in outcomes.values()}) == 1
    assert len({o["node_id"] for o in outcomes.values()}) == 1
    stats = api.get(f"/api/v1/tasks/{task}/stats").json()
    assert (stats["calls"], stats["hits"], stats["oracle_hits"], stats["executions"]) == (3, 2, 2, 1)
    # A rollout that waited has no sandbox yet; its next miss gets one in the same state.
    waited = next(r for r, o in outcomes.items() if o["cached"])
    assert run(api, task, waited, bash("echo ok > /f; cat /f"))["result"]["stdout"] == "ok\n"


@pytest.mark.parametrize("depth", [1, 6])
def test_a_miss_on_the_lane_that_runs_tools_issues_a_constant_number_of_statements(api, docker_task, depth):
    """A rollout's miss in its own sandbox, as the front door runs it off the hits' lane: the same
    statements whatever the history's length, the single-flight claim taken by the lookup's own
    statement and no statement to give it back once the result is recorded."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from cache.tcg import ToolCall
    from core.lanes import LaneContext, lane_set
    from sandboxes.services import rollout_call

    task = docker_task(f"counted-{depth}")
    for i in range(depth):
        assert run(api, task, "r1", bash(f"echo {i} >> f"))["cached"] is False
    lane_set(LaneContext(fast=False, waited_s=0.0, wait_until=None))
    try:
        with CaptureQueriesContext(connection) as statements:
            outcome = rollout_call(
                task_id=task, rollout_id="r1", call=ToolCall("bash", {"command": "echo x >> f; wc -l f"})
            )
    finally:
        lane_set(None)
    assert (outcome.cached, outcome.result["stdout"]) == (False, f"{depth + 1} f\n")
    sql = [q["sql"] or "" for q in statements.captured_queries]
    assert not any("DELETE FROM cache_claim" in s for s in sql)  # the recorded node's claim lapses by itself
    assert not any("WITH claimed AS" in s for s in sql)  # the call's claim rode in the lookup's statement
    # prepared, their text not captured: the rollout's claim, the lookup, the task with the sandbox
    # read and marked, the record
    assert sum(not s for s in sql) == 4
    # the rollout's claim, the lookup, the task with the sandbox read and marked (its reservation
    # free: one statement); the record (the node, the sandbox's progress, the history: one
    # statement); the rollout's release
    assert len(sql) == 5, "\n".join(s[:120] for s in sql)


def test_a_miss_its_project_refuses_leaves_the_rollouts_sandbox_as_it_was(api, docker_task):
    """The miss marks the rollout's own sandbox `executing` as it reads its task (one statement),
    then checks the project's grants: a refused miss gives the mark back, so that the rollout's
    next miss, once the grant is back, runs in the same sandbox rather than retiring it as one cut
    off mid-call."""
    from accounts.models import Project
    from cache.models import Task

    task = docker_task("refused-mid")
    assert run(api, task, "r1", bash("echo a > f"))["cached"] is False
    own = Sandbox.objects.get(rollout__rollout_id="r1", state="leased")
    project = Project.objects.filter(pk=Task.objects.get(pk=task).project_id)
    memory = project.values_list("max_memory_mb", flat=True).get()
    project.update(max_memory_mb=64)  # below the task's default: the grant is taken back
    refused = api.post(f"/api/v1/tasks/{task}/rollouts/r1/calls", {"call": bash("echo b >> f")}, format="json")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "limit_exceeded"
    assert not Sandbox.objects.get(pk=own.pk).executing
    project.update(max_memory_mb=memory)
    assert run(api, task, "r1", bash("echo c >> f; cat f"))["result"]["stdout"] == "a\nc\n"
    assert Sandbox.objects.get(rollout__rollout_id="r1", state="leased").pk == own.pk
