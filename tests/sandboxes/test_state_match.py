"""State-keyed hits (docs/design/state-match.md) in tool-server mode, on the real Docker engine:
a call seen before from a state with the same verified fingerprint is served from there, and only
then. Each answer is also checked against what the rollout's own history gives when executed."""

from __future__ import annotations

import pytest

from cache.models import MergeBan, Node
from cache.selectors import task_stats
from cache.services import divergence_record, node_audit
from tests.support.toolserver import bash, run

pytestmark = pytest.mark.django_db(transaction=True)


def write(path: str, content: str, second: int) -> dict:
    """A write that leaves the file a time of its own: which whole second two writes share, which
    a state's identity includes, does not depend on how fast the test runs."""
    return bash(f"echo {content} > {path}; touch -d '2001-01-01 00:00:{second:02d}' {path}")


WRITE_X, WRITE_Y, WRITE_Y0 = write("/x", 1, 1), write("/y", 2, 2), write("/y", 0, 5)
READ = bash("cat /x /y; ls -l --full-time /x /y | wc -l")


def _state_task(docker_task, name: str, match: str = "state") -> str:
    return docker_task(name, match=match, audit_rate=0.0)


def test_two_histories_that_reach_one_state_share_the_next_call(api, docker_task):
    task = _state_task(docker_task, "merge")
    for call in (WRITE_X, WRITE_Y):
        run(api, task, "r1", call)
    first = run(api, task, "r1", READ)
    assert first["cached"] is False
    # r2 writes the same files in another order of calls, and ends where r1 did: the same contents
    # and the same order of file times (/y rewritten last).
    for call in (WRITE_Y0, WRITE_X, WRITE_Y):
        assert run(api, task, "r2", call)["cached"] is False
    second = run(api, task, "r2", READ)
    assert second["cached"] is True
    assert second["result"] == first["result"]
    merged = Node.objects.get(pk=second["node_id"])
    assert (
        merged.merged_from == first["node_id"]
        and merged.result_json == Node.objects.get(pk=first["node_id"]).result_json
    )
    exported = {n["id"]: n for n in api.get(f"/api/v1/tasks/{task}/graph").json()["nodes"]}
    assert exported[second["node_id"]]["merged_from"] == first["node_id"]
    assert exported[first["node_id"]]["merged_from"] is None
    stats = task_stats(task_id=task)
    assert (stats["state_hits"], stats["hits"]) == (1, 1)
    assert stats["oracle_hits"] == 0 and stats["state_oracle_hits"] == 1
    # r2's history goes on as its own: its next calls look up by its history first, and its
    # sandbox, a call behind, catches up and runs the next miss in the state its history says.
    assert run(api, task, "r2", READ)["cached"] is True  # by history now: the merged node is r2's
    after = run(api, task, "r2", bash("cat /y; echo 3 > /z"))
    assert (after["cached"], after["result"]["stdout"]) == (False, "2\n")


def test_a_state_that_differs_only_in_the_order_of_file_times_does_not_merge(api, docker_task):
    task = _state_task(docker_task, "order")
    run(api, task, "r1", WRITE_X)
    run(api, task, "r1", WRITE_Y)
    run(api, task, "r1", READ)
    # Same contents, /x newer than /y: `make` would see another state.
    run(api, task, "r2", WRITE_Y)
    run(api, task, "r2", write("/x", 1, 3))
    assert run(api, task, "r2", READ)["cached"] is False
    stats = task_stats(task_id=task)
    assert stats["state_hits"] == 0 and stats["state_oracle_hits"] == 0


def test_a_state_that_differs_only_in_a_live_process_does_not_merge(api, docker_task):
    task = _state_task(docker_task, "process")
    run(api, task, "r1", WRITE_X)
    run(api, task, "r1", WRITE_Y)
    run(api, task, "r1", READ)
    # The same files, and a process left running: another state.
    run(api, task, "r2", bash("sleep 300 >/dev/null 2>&1 & echo 0 > /y"))
    run(api, task, "r2", WRITE_X)
    run(api, task, "r2", WRITE_Y)
    assert run(api, task, "r2", READ)["cached"] is False
    # Without the process the same steps reach r1's state, and merge (the control).
    run(api, task, "r3", bash("echo 0 > /y"))
    run(api, task, "r3", WRITE_X)
    run(api, task, "r3", WRITE_Y)
    assert run(api, task, "r3", READ)["cached"] is True


def test_a_merged_node_the_audit_finds_divergent_stops_merging(api, docker_task):
    task = _state_task(docker_task, "banned")
    for call in (WRITE_X, WRITE_Y):
        run(api, task, "r1", call)
    first = run(api, task, "r1", READ)
    for call in (WRITE_Y0, WRITE_X, WRITE_Y):
        run(api, task, "r2", call)
    second = run(api, task, "r2", READ)
    assert second["cached"] is True
    # The audit re-executes the merged call along r2's own history and gets another answer.
    assert node_audit(task_id=task, node_id=second["node_id"], result={"stdout": "other", "exit_code": 0}) is True
    ban = MergeBan.objects.get(task_id=task)
    assert ban.fingerprint == Node.objects.get(pk=second["node_id"]).parent.state_fingerprint
    # Neither r2's history nor a third history reaching the state is served from the merge now;
    # r1's own history still is.
    again = run(api, task, "r2", READ)
    assert again["cached"] is False and again["result"] == first["result"]
    for call in (write("/y", 9, 7), WRITE_X, WRITE_Y):
        run(api, task, "r3", call)
    assert run(api, task, "r3", READ)["cached"] is False
    assert run(api, task, "r4", WRITE_X) and run(api, task, "r4", WRITE_Y)
    assert run(api, task, "r4", READ)["cached"] is True  # r1's history


def test_matching_by_history_counts_the_state_oracle_and_serves_nothing_from_it(api, docker_task):
    task = _state_task(docker_task, "history", match="history")
    for call in (WRITE_X, WRITE_Y):
        run(api, task, "r1", call)
    run(api, task, "r1", READ)
    for call in (WRITE_Y0, WRITE_X, WRITE_Y):
        run(api, task, "r2", call)
    assert run(api, task, "r2", READ)["cached"] is False
    stats = task_stats(task_id=task)
    assert (stats["hits"], stats["state_hits"], stats["state_oracle_hits"]) == (0, 0, 1)
    assert api.get(f"/api/v1/tasks/{task}").json()["match"] == "history"


@pytest.mark.parametrize("snapshots", [False, True], ids=["replayed", "forked"])
def test_a_merged_write_is_materialized_in_the_state_its_merge_recorded(api, docker_task, snapshots, request):
    if snapshots:
        request.getfixturevalue("snapshot_every_call")
    task = _state_task(docker_task, f"write-{snapshots}")
    write_z = bash("echo 3 > /z; echo done")
    for call in (WRITE_X, WRITE_Y, write_z):
        run(api, task, "r1", call)
    for call in (WRITE_Y0, WRITE_X, WRITE_Y):
        run(api, task, "r2", call)
    merged = run(api, task, "r2", write_z)
    assert (merged["cached"], merged["mutates"]) == (True, True)
    node = Node.objects.get(pk=merged["node_id"])
    source = Node.objects.get(pk=node.merged_from)
    assert (node.state_fingerprint, node.file_times) == (source.state_fingerprint, None)
    # r2's sandbox did not run the write: its next miss runs where r2's history leads (the write
    # replayed in its sandbox, or the merge's snapshot forked, and checked against the recorded
    # state; a sandbox that fails the check goes on as its own, off the shared graph).
    probe = "cat /z /x /y; stat -c '%n %.9Y' /x /y /z | sort -n -k2 | cut -d' ' -f1 | tr '\\n' ' '"
    after = run(api, task, "r2", bash(probe))
    assert (after["cached"], after["result"]["stdout"]) == (False, "3\n1\n2\n/x /y /z ")
    # A rollout with no sandbox of its own, on r2's history: materialized the same way.
    for call in (WRITE_Y0, WRITE_X, WRITE_Y, write_z):
        assert run(api, task, "r3", call)["cached"] is True
    fresh = run(api, task, "r3", bash(probe + " # r3"))
    assert (fresh["cached"], fresh["result"]["stdout"]) == (False, "3\n1\n2\n/x /y /z ")
    if snapshots:  # forked from the merge's snapshot: an exact copy of the state it recorded
        assert not Node.objects.filter(task_id=task, divergent=True).exists()


def test_a_state_below_a_divergent_node_does_not_merge(api, docker_task):
    task = _state_task(docker_task, "tainted")
    first = [run(api, task, "r1", call) for call in (WRITE_X, WRITE_Y)]
    run(api, task, "r1", READ)
    # The audit found r1's first write giving another state: what came after it is not a function
    # of r1's history, and its fingerprints vouch for nothing.
    divergence_record(task_id=task, node_id=first[0]["node_id"], tool="bash", kind="drift", expected={}, observed={})
    for call in (WRITE_Y0, WRITE_X, WRITE_Y):
        run(api, task, "r2", call)
    assert run(api, task, "r2", READ)["cached"] is False
    assert task_stats(task_id=task)["state_oracle_hits"] == 0
