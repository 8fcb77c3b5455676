"""Projects and scoped tokens, over the REST API: two projects, both roles, every route.

- isolation: another project's task, node, lease or rollout answers 404 (never 403) to both roles;
- the same task id in two projects holds two separate graphs;
- a trainer may look up, record, register snapshots, release leases, create tasks and announce
  steps, and gets 403 `maintainer_required` for changing a task's env, tools or budget, flushing,
  evicting and pinning; a maintainer may, and each change is in the audit log with its token;
- grants: a snapshot past the project's bytes answers 403 (a request past its rate: 429, in
  tests/accounts/test_tokens.py);
- the hot path stays one statement in any project."""

from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from accounts.models import Project
from accounts.projects import task_key
from accounts.services.tokens import token_create
from cache.ledger import ledger_flush
from cache.models import AuditEntry, Node, Snapshot, Task
from tests.support.api import call, lookup, project_clients, record

pytestmark = pytest.mark.django_db

W = call("write", path="f", content="1")
R = call("read", path="f")
EXTERNAL = {
    "env": {"backend": "external", "name": "projects"},
    "tools": {"read": {"mutates_state": False}},
    "sandbox_budget": 4,
}


@pytest.fixture
def clients():
    return project_clients()


@pytest.fixture
def world(clients):
    """Project alpha's task "only-alpha" with a graph (W, then R or a second write), a client snapshot
    on W leased by a lookup, and a rollout; "task-0" in both projects."""
    alpha = clients["alpha", "maintainer"]
    assert alpha.put("/api/v1/tasks/only-alpha", EXTERNAL, format="json").status_code == 201
    write = record(alpha, "only-alpha", [], W, {"ok": True}, exec_ms=500.0, rollout_id="r1")["node_id"]
    read = record(alpha, "only-alpha", [W], R, {"output": "1"}, rollout_id="r1")["node_id"]
    response = alpha.post(
        f"/api/v1/tasks/only-alpha/nodes/{write}/snapshots",
        {"ref": "alpha-snap", "backend": "external", "size_bytes": 10},
        format="json",
    )
    assert response.status_code == 201, response.content
    miss = lookup(alpha, "only-alpha", [W], call("write", path="g", content="2"), rollout_id="r2")
    lease = miss["resume"]["lease_id"]
    bare = record(alpha, "only-alpha", [W], call("write", path="g", content="2"), {"ok": 2}, rollout_id="r2")["node_id"]
    for project in ("alpha", "beta"):
        assert clients[project, "maintainer"].put("/api/v1/tasks/task-0", EXTERNAL, format="json").status_code == 201
    ledger_flush()  # the lookup's rollout r2 is a row now
    return {"write": write, "read": read, "bare": bare, "lease": lease}


def routes(task: str, node: int, lease: str) -> list[tuple[str, str, dict | None]]:
    """Every REST route that names a task, a node or a lease (tool-server calls: test_projects of
    tests/sandboxes), with a valid body."""
    history = {"history": [W], "call": R, "rollout_id": "r9"}
    return [
        ("get", f"/api/v1/tasks/{task}", None),
        ("get", f"/api/v1/tasks/{task}/stats", None),
        ("get", f"/api/v1/tasks/{task}/graph", None),
        ("get", f"/api/v1/tasks/{task}/graph?root={node}", None),
        ("post", f"/api/v1/tasks/{task}/lookup", history),
        ("post", f"/api/v1/tasks/{task}/record", {**history, "result": {"output": "1"}, "exec_ms": 1.0}),
        ("post", f"/api/v1/tasks/{task}/claims/release", history),
        ("post", f"/api/v1/tasks/{task}/file-times", {"history": [W], "call": R, "replay": [W]}),
        ("post", f"/api/v1/tasks/{task}/nodes/{node}/snapshots", {"ref": "other-snap", "backend": "external"}),
        ("post", f"/api/v1/tasks/{task}/nodes/{node}/audit", {"result": {"ok": True}}),
        ("post", f"/api/v1/tasks/{task}/flush", None),
        ("post", f"/api/v1/tasks/{task}/nodes/{node}/evict", {"subtree": False}),
        ("put", f"/api/v1/tasks/{task}/nodes/{node}/pin", {"pinned": True}),
        ("delete", f"/api/v1/tasks/{task}/rollouts/r2", None),
        ("delete", f"/api/v1/leases/{lease}", None),
    ]


def send(client: APIClient, method: str, path: str, body: dict | None):
    return getattr(client, method)(path, body, format="json") if body is not None else getattr(client, method)(path)


@pytest.mark.parametrize("role", ["trainer", "maintainer"])
def test_another_projects_task_node_and_lease_are_404_on_every_route(clients, world, role):
    beta = clients["beta", role]
    for method, path, body in routes("only-alpha", world["write"], world["lease"]):
        response = send(beta, method, path, body)
        assert response.status_code == 404, (method, path, response.content)
        assert response.json()["error"]["code"].startswith("unknown_"), (path, response.content)
    # Alpha's node ids under beta's own task of the same name: unknown nodes, not alpha's.
    for method, path, body in routes("task-0", world["write"], world["lease"]):
        if "/nodes/" in path or "root=" in path:
            response = send(beta, method, path, body)
            assert response.status_code == 404, (method, path, response.content)
    # Nothing of alpha's changed or went.
    assert Node.objects.filter(task_id="alpha.only-alpha").count() == 3
    assert Snapshot.objects.get(ref="alpha-snap").status == Snapshot.Status.LIVE
    assert not Node.objects.get(pk=world["write"]).pinned
    # Lists and steps only know the caller's project.
    assert [t["id"] for t in beta.get("/api/v1/tasks").json()["tasks"]] == ["task-0"]
    steps = beta.post("/api/v1/steps", {"tasks": ["only-alpha"], "rollouts_per_task": 2}, format="json")
    assert steps.status_code == 202 and steps.json()["planned"] == {}
    pools = beta.get("/api/v1/pools").json()
    assert pools["pools"] == [] and pools["tasks"] == [] and pools["count"] == 0
    alpha = clients["alpha", role].get("/api/v1/pools").json()
    assert [(t["task_id"], t["snapshots"]) for t in alpha["tasks"]] == [("only-alpha", 1)]


def test_the_owning_project_reaches_every_route_and_roles_split_the_changes(clients, world):
    trainer, maintainer = clients["alpha", "trainer"], clients["alpha", "maintainer"]
    maintainer_only = ("/flush", "/evict", "/pin")
    for method, path, body in routes("only-alpha", world["bare"], world["lease"]):
        if path.endswith(maintainer_only):
            refused = send(trainer, method, path, body)
            assert refused.status_code == 403, (path, refused.content)
            assert refused.json()["error"]["code"] == "maintainer_required"
            continue
        response = send(trainer, method, path, body)
        assert response.status_code in (200, 201, 204), (method, path, response.content)
    # The maintainer's actions go through, in the order of a graph's life: pin, evict, flush.
    node = world["write"]
    assert send(maintainer, "put", f"/api/v1/tasks/only-alpha/nodes/{node}/pin", {"pinned": True}).status_code == 200
    assert Node.objects.get(pk=node).pinned
    evicted = send(maintainer, "post", f"/api/v1/tasks/only-alpha/nodes/{node}/evict", {"subtree": False})
    assert evicted.status_code == 200 and evicted.json()["details"]["snapshot"]["ref"] == "alpha-snap"
    flushed = send(maintainer, "post", "/api/v1/tasks/only-alpha/flush", None)
    assert flushed.status_code == 200 and flushed.json()["details"]["nodes_deleted"] == 3
    assert not Node.objects.filter(task_id="alpha.only-alpha").exists()
    # Every maintainer action and every trainer refusal is in alpha's audit log, by token name.
    log = list(
        AuditEntry.objects.filter(project__name="alpha")
        .order_by("at", "id")
        .values_list("actor_name", "action", "outcome")
    )
    assert ("token:alpha-trainer", "task_flush", "refused") in log
    assert ("token:alpha-trainer", "node_pin", "refused") in log
    assert log[-3:] == [
        ("token:alpha-maintainer", "node_pin", "ok"),
        ("token:alpha-maintainer", "snapshot_evict", "ok"),
        ("token:alpha-maintainer", "task_flush", "ok"),
    ]


def test_the_same_task_id_in_two_projects_holds_two_graphs(clients):
    alpha, beta = clients["alpha", "trainer"], clients["beta", "trainer"]
    for client in (alpha, beta):
        assert client.put("/api/v1/tasks/task-0", EXTERNAL, format="json").status_code == 201
    record(alpha, "task-0", [], W, {"ok": "alpha"})
    assert lookup(beta, "task-0", [], W)["hit"] is False  # alpha's result is not beta's
    record(beta, "task-0", [], W, {"ok": "beta"})
    record(beta, "task-0", [W], R, {"output": "beta read"})
    assert lookup(alpha, "task-0", [], W)["result"] == {"ok": "alpha"}
    assert lookup(beta, "task-0", [], W)["result"] == {"ok": "beta"}
    assert lookup(alpha, "task-0", [W], R)["hit"] is False
    graphs = {
        name: client.get("/api/v1/tasks/task-0/graph").json() for name, client in (("alpha", alpha), ("beta", beta))
    }
    assert (len(graphs["alpha"]["nodes"]), len(graphs["beta"]["nodes"])) == (1, 2)
    assert graphs["alpha"]["task_id"] == graphs["beta"]["task_id"] == "task-0"  # each answered by its own id
    assert {n["id"] for n in graphs["alpha"]["nodes"]}.isdisjoint({n["id"] for n in graphs["beta"]["nodes"]})
    stats = {name: client.get("/api/v1/tasks/task-0").json() for name, client in (("alpha", alpha), ("beta", beta))}
    assert stats["alpha"]["id"] == stats["beta"]["id"] == "task-0"
    assert (stats["alpha"]["stats"]["calls"], stats["beta"]["stats"]["calls"]) == (2, 2)
    assert set(Task.objects.values_list("pk", flat=True)) == {"alpha.task-0", "beta.task-0"}
    # A flush of one leaves the other whole.
    assert clients["beta", "maintainer"].post("/api/v1/tasks/task-0/flush").status_code == 200
    assert lookup(alpha, "task-0", [], W)["hit"] is True


def test_a_trainer_creates_and_puts_again_but_cannot_change_env_tools_or_budget(clients):
    trainer, maintainer = clients["alpha", "trainer"], clients["alpha", "maintainer"]
    assert trainer.put("/api/v1/tasks/t", EXTERNAL, format="json").status_code == 201
    record(trainer, "t", [], W, {"ok": True})
    assert trainer.put("/api/v1/tasks/t", EXTERNAL, format="json").status_code == 200  # as it is: no change
    assert trainer.put("/api/v1/tasks/t", {**EXTERNAL, "sandbox_budget": None}, format="json").status_code == 200
    changes = {
        "env": {**EXTERNAL, "env": {"backend": "external", "name": "other"}},
        "tools": {**EXTERNAL, "tools": {}},
        "sandbox_budget": {**EXTERNAL, "sandbox_budget": 9},
        "retention": {**EXTERNAL, "max_nodes": 5},
    }
    for field, body in changes.items():
        response = trainer.put("/api/v1/tasks/t", body, format="json")
        assert response.status_code == 403, (field, response.content)
        assert (
            response.json()["error"]["code"] == "maintainer_required" and field in response.json()["error"]["message"]
        )
    assert lookup(trainer, "t", [], W)["hit"] is True  # the graph is as it was
    response = maintainer.put("/api/v1/tasks/t", changes["env"], format="json")
    assert response.status_code == 200
    assert lookup(trainer, "t", [], W)["hit"] is False  # a new environment: the graph was dropped
    entry = AuditEntry.objects.get(action="task_update")
    assert (entry.actor_name, entry.project.name, entry.details["changed"], entry.details["nodes_dropped"]) == (
        "token:alpha-maintainer",
        "alpha",
        ["env"],
        1,
    )
    assert maintainer.put("/api/v1/tasks/t", {**changes["env"], "sandbox_budget": 9}, format="json").status_code == 200
    assert AuditEntry.objects.filter(action="task_update").count() == 2


def test_a_snapshot_past_the_projects_bytes_is_403(clients):
    Project.objects.filter(name="alpha").update(max_snapshot_bytes=100)
    client = clients["alpha", "trainer"]
    client.put("/api/v1/tasks/t", EXTERNAL, format="json")
    first = record(client, "t", [], W, {"ok": 1})["node_id"]
    second = record(client, "t", [W], call("write", path="g", content="2"), {"ok": 2})["node_id"]
    ok = client.post(
        f"/api/v1/tasks/t/nodes/{first}/snapshots", {"ref": "a", "backend": "external", "size_bytes": 60}, format="json"
    )
    assert ok.status_code == 201
    refused = client.post(
        f"/api/v1/tasks/t/nodes/{second}/snapshots",
        {"ref": "b", "backend": "external", "size_bytes": 60},
        format="json",
    )
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "snapshot_quota_exceeded"
    assert refused.json()["error"]["details"]["live_bytes"] == 60
    # Beta has no such grant: its snapshots are not bounded by alpha's.
    beta = clients["beta", "trainer"]
    beta.put("/api/v1/tasks/t", EXTERNAL, format="json")
    node = record(beta, "t", [], W, {"ok": 1})["node_id"]
    assert (
        beta.post(
            f"/api/v1/tasks/t/nodes/{node}/snapshots",
            {"ref": "a", "backend": "external", "size_bytes": 10**9},
            format="json",
        ).status_code
        == 201
    )


@pytest.mark.django_db(transaction=True)
def test_a_hit_is_one_statement_in_any_project(clients, django_assert_num_queries):
    from tests.cache.test_hot_path import body, in_thread

    key = token_create(name="hot", project="gamma", role="trainer")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    assert client.put("/api/v1/tasks/hot", EXTERNAL, format="json").status_code == 201
    record(client, "hot", [], W, {"ok": True})
    in_thread("/api/v1/tasks/hot/lookup", body(history=[], call=W), f"Token {key}")  # cached
    with django_assert_num_queries(1):
        status, content = in_thread("/api/v1/tasks/hot/lookup", body(history=[], call=W), f"Token {key}")
    assert status == 200 and json.loads(content)["hit"] is True


def test_old_clients_of_the_default_project_keep_their_ids(api, toy_task):
    assert Task.objects.get(pk="toy").project.name == "default"  # the key is the id itself
    assert task_key("default", "toy") == "toy" and task_key("alpha", "toy") == "alpha.toy"
    assert api.get("/api/v1/tasks/toy").json()["id"] == "toy"
