"""The rollout tree export (GET /tasks/{id}/tree): each rollout's path through the graph, in call
order, with its branch origin and what the trainer said of it, paginated."""

import hashlib

import orjson
import pytest
from asgiref.sync import async_to_sync

from cache.models import Node, RolloutStep
from tests.support.api import call, lookup, record

pytestmark = pytest.mark.django_db(transaction=True)

W1, W2, W3 = (call("write", path="f", content=str(i)) for i in range(3))
R = call("read", path="f")


def export(api, task="toy", **params) -> list[dict]:
    response = api.get(f"/api/v1/tasks/{task}/tree", params)
    assert response.status_code == 200, response.content
    assert response["Content-Type"] == "application/x-ndjson"
    # As the ASGI handler reads it, each block made in this thread (its database connection).
    return [orjson.loads(line) for line in async_to_sync(_read)(response.streaming_content).splitlines()]


async def _read(content) -> bytes:
    return b"".join([block async for block in content])


def run(api, rollout, calls, results, **fields):
    """A client-mode rollout: each call looked up, and recorded where it missed."""
    history = []
    for seq, (c, result) in enumerate(zip(calls, results, strict=True)):
        trace = {"seq": seq, "tokens": {"prompt": [0, 10 * seq + 5], "completion": [10 * seq + 5, 10 * seq + 10]}}
        if not lookup(api, "toy", history, c, rollout_id=rollout, **trace, **fields)["hit"]:
            record(api, "toy", history, c, result, rollout_id=rollout, **trace, **fields)
        if c["tool"] != "read":
            history.append(c)


def test_the_export_gives_each_rollouts_path_branch_origin_and_trace(api, toy_task):
    run(api, "r1", [W1, R, W2], [{"ok": 1}, {"content": "1"}, {"ok": 2}], trajectory_ref="traj-1", epoch=3)
    # A client-mode branch of r1 after its first state-changing call, told by its calls.
    branch = {"rollout": "r1", "step": 1, "tokens": {"prompt": [0, 15]}}
    run(api, "b1", [W1, R, W3], [{"ok": 1}, {"content": "1"}, {"ok": 3}], branch_of=branch, epoch=3)
    lines = export(api, epoch=3)
    assert lines[0] == {"kind": "task", "task_id": "toy", "epoch": 3}
    assert lines[-1] == {"kind": "end", "rollouts": 2, "next": None}
    r1, b1 = sorted(lines[1:-1], key=lambda line: line["rollout_id"], reverse=True)
    assert (r1["rollout_id"], r1["trajectory_ref"], r1["branch"], r1["epoch"]) == ("r1", "traj-1", None, 3)
    assert b1["branch"] == {"rollout": "r1", "step": 1, "node_id": None, "tokens": {"prompt": [0, 15]}}
    nodes = {n.pk: n for n in Node.objects.filter(task_id="toy")}
    assert [c["cached"] for c in r1["calls"]] == [False, False, False]
    assert [c["cached"] for c in b1["calls"]] == [True, True, False]
    for rollout in (r1, b1):
        assert [c["step"] for c in rollout["calls"]] == [0, 1, 2]
        assert [c["tokens"]["prompt"] for c in rollout["calls"]] == [[0, 5], [0, 15], [0, 25]]
        for c in rollout["calls"]:
            node = nodes[c["node_id"]]
            assert (c["tool"], c["mutates"], c["parent_id"]) == (node.tool, node.mutates, node.parent_id)
            assert c["result_sha256"] == hashlib.sha256(node.result_json.encode()).hexdigest()
    # The two paths share their first two nodes and part after them.
    assert [c["node_id"] for c in r1["calls"]][:2] == [c["node_id"] for c in b1["calls"]][:2]
    assert r1["calls"][2]["node_id"] != b1["calls"][2]["node_id"]
    assert export(api, epoch=4)[1:] == [{"kind": "end", "rollouts": 0, "next": None}]


def test_a_late_record_keeps_its_place_in_the_path(api, toy_task):
    """tvclient records misses in the background: the next call's lookup may come first."""
    first, second = call("read", path="a"), call("read", path="b")
    record(api, "toy", [], second, {"content": ""})
    assert not lookup(api, "toy", [], first, rollout_id="r1", seq=0)["hit"]  # recorded after the next call
    assert lookup(api, "toy", [], second, rollout_id="r1", seq=1)["hit"]
    record(api, "toy", [], first, {"content": ""}, rollout_id="r1", seq=0)
    (rollout,) = export(api)[1:-1]
    assert [c["node_id"] for c in rollout["calls"]] == [
        Node.objects.get(task_id="toy", call__args__path=path).pk for path in ("a", "b")
    ]


def test_pages_follow_the_cursor_and_every_rollout_comes_once(api, toy_task):
    for i in range(5):
        run(api, f"r{i}", [W1], [{"ok": 1}])
    seen, after = [], None
    while True:
        lines = export(api, limit=2, **({"after": after} if after else {}))
        seen += [line["rollout_id"] for line in lines[1:-1]]
        after = lines[-1]["next"]
        if after is None:
            break
    assert sorted(seen) == [f"r{i}" for i in range(5)]
    assert RolloutStep.objects.count() == 5


@pytest.mark.parametrize(
    "params", [{"epoch": "x"}, {"limit": 0}, {"limit": 10**6}, {"after": -1}], ids=["epoch", "limit0", "limit", "after"]
)
def test_a_bad_query_is_refused(api, toy_task, params):
    response = api.get("/api/v1/tasks/toy/tree", params)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_payload"


@pytest.mark.parametrize(
    "fields",
    [
        {"tokens": {"prompt": [5, 2]}},
        {"tokens": {"prompt": [0]}},
        {"tokens": {"answer": [0, 1]}},
        {"seq": -1},
        {"trajectory_ref": "x" * 1001},
        {"trajectory_ref": 3},
        {"branch_of": {"rollout": "r1"}},
        {"branch_of": {"rollout": "r1", "step": 0, "tokens": {"completion": [0, 1]}}},
    ],
)
def test_bad_trace_fields_are_refused_and_nothing_is_recorded(api, toy_task, fields):
    response = api.post(
        "/api/v1/tasks/toy/record",
        {"history": [], "call": W1, "result": {}, "exec_ms": 1.0, "rollout_id": "r1", **fields},
        format="json",
    )
    assert response.status_code == 400, response.content
    assert response.json()["error"]["code"] == "invalid_payload"
    assert not Node.objects.filter(task_id="toy").exists()
