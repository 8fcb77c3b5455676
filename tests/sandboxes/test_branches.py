"""Branching in tool-server mode: rollouts started at a rollout's step or a node, each with a
sandbox already in that state (sandboxes/services/branches.py)."""

from __future__ import annotations

import pytest

from accounts.models import Project
from cache.models import Node, Rollout, Snapshot
from sandboxes.models import Sandbox
from sandboxes.services.pools import sandbox_warm
from tests.support.toolserver import BACKGROUND, bash, run

pytestmark = pytest.mark.django_db(transaction=True)

SETUP = [bash("echo a > /f"), bash("echo b >> /f"), bash("echo c >> /f")]


def branch(api, task: str, body: dict, status: int = 201) -> dict:
    response = api.post(f"/api/v1/tasks/{task}/branches", body, format="json")
    assert response.status_code == status, response.content
    return response.json()


def test_branches_continue_a_rollout_in_its_state_with_one_snapshot_and_one_replay(api, docker_task):
    task = docker_task("branch")
    for call in SETUP:
        run(api, task, "r1", call)
    node = Node.objects.get(task_id=task, depth=2)  # after `echo b`: no snapshot (a quick call)
    assert not Snapshot.objects.filter(node=node).exists()
    opened = branch(
        api, task, {"from": {"rollout": "r1", "step": 2}, "count": 4, "rollout_ids": ["b0", "b1", "b2", "b3"]}
    )
    assert opened["node_id"] == node.pk and opened["history"] == [c for c in SETUP[:2]]
    how = [b["materialized"] for b in opened["branches"]]
    assert how == ["root", "on_miss", "on_miss", "on_miss"]  # one replay; the others fork its snapshot
    assert Snapshot.objects.filter(node=node, status="live").count() == 1
    # The first branch's sandbox reached the state and was snapshotted; one fork of that snapshot
    # warms in the pool (a worker starts it: here, the test), which the first miss takes; the other
    # branches' misses fork the snapshot themselves.
    assert Sandbox.objects.get(rollout__rollout_id="b0", state="leased").applied == 2
    (prefork,) = Sandbox.objects.filter(task_id=task, pool="fork", snapshot__node=node, rollout=None)
    sandbox_warm(sandbox_id=prefork.pk)
    for i in range(4):
        answer = run(api, task, f"b{i}", bash(f"echo x{i} >> /f; cat /f"))
        assert (answer["cached"], answer["result"]["stdout"]) == (False, f"a\nb\nx{i}\n")  # r1's c is not there
    leased = Sandbox.objects.filter(rollout__rollout_id__in=["b0", "b1", "b2", "b3"], state="leased")
    assert leased.count() == 4 and Sandbox.objects.get(pk=prefork.pk).state == "leased"
    # A branch's calls are looked up after its history like any rollout's.
    assert run(api, task, "b0", bash("echo x0 >> /f; cat /f"), status=200)["cached"] is False  # its own state moved
    assert Rollout.objects.get(rollout_id="b2").branch_of == "r1"


def test_a_branch_at_a_node_and_at_the_root(api, docker_task):
    task = docker_task("branch-node")
    for call in SETUP:
        run(api, task, "r1", call)
    node = Node.objects.get(task_id=task, depth=1)
    opened = branch(api, task, {"from": {"node_id": node.pk}, "count": 1})
    (only,) = opened["branches"]
    assert run(api, task, only["rollout_id"], bash("cat /f"))["result"]["stdout"] == "a\n"
    root = branch(api, task, {"from": {"rollout": "r1", "step": 0}, "count": 1})
    assert root["node_id"] is None and root["history"] == []
    assert run(api, task, root["branches"][0]["rollout_id"], bash("cat /f 2>&1"))["result"]["exit_code"] != 0


def test_branches_of_a_state_with_a_live_process_each_reach_it(api, docker_task):
    task = docker_task("branch-process")
    start, probe, alive = BACKGROUND
    run(api, task, "r1", bash(start))
    opened = branch(api, task, {"from": {"rollout": "r1", "step": 1}, "count": 2})
    for b in opened["branches"]:
        assert b["materialized"] == "root"  # no snapshot of its files alone stands in for it: each replays
        answer = run(api, task, b["rollout_id"], bash(probe))
        assert answer["result"]["stdout"] == alive


def test_branches_beyond_the_projects_sandboxes_are_refused(api, docker_task):
    task = docker_task("branch-quota")
    run(api, task, "r1", SETUP[0])  # r1 holds one sandbox
    Project.objects.filter(name="default").update(max_live_sandboxes=3)
    refused = branch(api, task, {"from": {"rollout": "r1", "step": 1}, "count": 3}, status=429)
    assert refused["error"]["code"] == "sandbox_quota_exceeded"
    assert not Rollout.objects.filter(task_id=task, branch_of="r1").exists()
    assert len(branch(api, task, {"from": {"rollout": "r1", "step": 1}, "count": 2})["branches"]) == 2


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"from": {"rollout": "r1", "step": 2}, "count": 1}, 400, "branch_step_out_of_range"),
        ({"from": {"rollout": "nobody", "step": 0}, "count": 1}, 404, "unknown_rollout"),
        ({"from": {"node_id": 999999999}, "count": 1}, 404, "unknown_node"),
        ({"from": {"rollout": "r1"}, "count": 1}, 400, "invalid_payload"),
        ({"from": {"rollout": "r1", "step": 1}, "count": 0}, 400, "invalid_payload"),
        ({"from": {"rollout": "r1", "step": 1}, "rollout_ids": ["r1"]}, 409, "rollout_exists"),
        ({"from": {"rollout": "r1", "step": 1}, "rollout_ids": ["x", "x"]}, 400, "invalid_payload"),
    ],
)
def test_bad_branch_requests(api, docker_task, body, status, code):
    task = docker_task("branch-bad")
    run(api, task, "r1", SETUP[0])
    assert branch(api, task, body, status=status)["error"]["code"] == code


def test_the_export_of_a_branched_epoch_gives_exactly_its_branch_structure(api, docker_task):
    """Branches of branches in tool-server mode, exported: each rollout's origin, its path through
    the graph (shared with its origin up to the branch point, its own after), its trace."""
    from tests.cache.test_tree_export import export

    task = docker_task("branch-export")
    for seq, call in enumerate(SETUP):
        run(api, task, "r1", call, epoch=5, trajectory_ref="t-r1", tokens={"prompt": [0, seq], "completion": [seq, 9]})
    branch(
        api,
        task,
        {
            "from": {"rollout": "r1", "step": 2},
            "count": 2,
            "rollout_ids": ["b0", "b1"],
            "epoch": 5,
            "tokens": {"prompt": [0, 40]},
            "trajectory_refs": ["t-b0", "t-b1"],
        },
    )
    for b in ("b0", "b1"):
        run(api, task, b, bash(f"echo {b} >> /f"), epoch=5)
    branch(api, task, {"from": {"rollout": "b0", "step": 3}, "count": 1, "rollout_ids": ["c0"], "epoch": 5})
    run(api, task, "c0", bash("cat /f"), epoch=5)
    lines = export(api, task, epoch=5)
    rollouts = {line["rollout_id"]: line for line in lines[1:-1]}
    assert set(rollouts) == {"r1", "b0", "b1", "c0"} and lines[-1]["next"] is None
    depth2 = Node.objects.get(task_id=task, depth=2).pk
    b0_node = Node.objects.get(task_id=task, call__args__command="echo b0 >> /f").pk
    assert rollouts["r1"]["branch"] is None
    for b in ("b0", "b1"):
        assert rollouts[b]["branch"] == {"rollout": "r1", "step": 2, "node_id": depth2, "tokens": {"prompt": [0, 40]}}
        assert rollouts[b]["trajectory_ref"] == f"t-{b}"
    assert rollouts["c0"]["branch"] == {"rollout": "b0", "step": 3, "node_id": b0_node, "tokens": None}
    path = {name: [c["node_id"] for c in rollout["calls"]] for name, rollout in rollouts.items()}
    assert path["r1"] == [Node.objects.get(task_id=task, call=call).pk for call in SETUP]
    assert path["b0"] == [b0_node] and path["c0"][0] not in path["b0"] + path["r1"]
    assert Node.objects.get(pk=path["b0"][0]).parent_id == depth2  # it continues from the branch point
    assert [c["tokens"] for c in rollouts["r1"]["calls"]] == [
        {"prompt": [0, i], "completion": [i, 9]} for i in range(3)
    ]
    assert all(not c["cached"] for c in rollouts["b1"]["calls"])
