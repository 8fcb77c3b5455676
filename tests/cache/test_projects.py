"""Projects and scoped tokens, over the REST API: two projects, both roles, every route.

- isolation: another project's task, node, lease or rollout answers 404 (never 403) to both roles;
- the same task id in two projects holds two separate graphs;
- a trainer may look up, record, register snapshots, release leases, create tasks and announce
  steps, and gets 403 `maintainer_required` for changing a task's env, tools or budget, flushing,
  evicting and pinning; a maintainer may, and each change is in the audit log with its token;
- grants: a snapshot past the project's bytes answers 403, a request past its rate 429 with
  Retry-After; tokens expire and are revoked (refused at once in this process once their cache
  lapses; `test_tokens_served` checks served processes);
- the hot path stays one statement in any project."""

from __future__ import annotations

import datetime as dt
import io
import json
import time

import pytest
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from cache.api import auth
from cache.api.auth import TOKEN_CACHE_TTL_S, principal_for_key, token_create
from cache.ledger import ledger_flush
from cache.models import ApiToken, AuditEntry, Membership, Node, Project, Snapshot, Task
from cache.projects import task_key
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
    assert pools["pools"] == [] and pools["snapshots"] == []
    assert [s["task_id"] for s in clients["alpha", role].get("/api/v1/pools").json()["snapshots"]] == ["only-alpha"]


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


def test_the_rate_limit_answers_429_with_retry_after_on_hot_and_cold_routes(clients, settings):
    Project.objects.filter(name="alpha").update(rate_limit=1, rate_burst=3)
    auth._verified.clear()
    auth._buckets.clear()
    client = clients["alpha", "trainer"]
    assert client.put("/api/v1/tasks/t", EXTERNAL, format="json").status_code == 201
    body = {"history": [], "call": W}
    statuses = [client.post("/api/v1/tasks/t/lookup", body, format="json") for _ in range(2)]
    assert [r.status_code for r in statuses] == [200, 200]
    refused = [client.post("/api/v1/tasks/t/lookup", body, format="json"), client.get("/api/v1/tasks/t")]
    for response in refused:
        assert response.status_code == 429, response.content
        assert response["Retry-After"] == "1" and response.json()["error"]["code"] == "rate_limited"
    # Beta is not alpha: its bucket is its own.
    beta = clients["beta", "trainer"]
    assert all(beta.get("/api/v1/tasks").status_code == 200 for _ in range(5))
    time.sleep(1.1)  # one request per second comes back
    assert client.get("/api/v1/tasks/t").status_code == 200


def test_expired_and_revoked_tokens_are_refused_once_their_cache_lapses(clients, monkeypatch):
    key = token_create(name="short", project="alpha", role="trainer", expires_in=dt.timedelta(seconds=1))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    assert client.get("/api/v1/tasks").status_code == 200
    time.sleep(1.1)  # the cached verification ends with the token's expiry, whatever the TTL
    refused = client.get("/api/v1/tasks")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_token"
    assert client.post("/api/v1/tasks/t/lookup", {"history": [], "call": W}, format="json").status_code == 401

    monkeypatch.setattr(auth, "TOKEN_CACHE_TTL_S", 0.5)
    other = token_create(name="revoked", project="alpha", role="maintainer")
    assert principal_for_key(other) is not None
    assert auth.token_revoke(name="revoked")
    assert principal_for_key(other) is not None  # still cached in this process ...
    time.sleep(0.6)
    assert principal_for_key(other) is None  # ... for at most the TTL
    assert TOKEN_CACHE_TTL_S <= 5.0


def test_a_token_says_when_it_was_last_used(clients):
    assert ApiToken.objects.get(name="alpha-trainer").last_used_at is None
    auth._verified.clear()
    clients["alpha", "trainer"].get("/api/v1/tasks")
    assert ApiToken.objects.get(name="alpha-trainer").last_used_at is not None


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


def test_token_and_project_commands(django_user_model):
    out = io.StringIO()
    call_command("create_token", "ci", "--project", "newproj", "--role", "maintainer", "--expires", "30", stdout=out)
    key = out.getvalue().strip()
    principal = principal_for_key(key)
    assert (principal.project, principal.role) == ("newproj", "maintainer")
    token = ApiToken.objects.get(name="ci")
    assert token.key_digest != key and key not in token.key_digest  # only the digest is stored
    assert dt.timedelta(days=29) < token.expires_at - token.created_at <= dt.timedelta(days=30)
    call_command("create_token", "plain", stdout=io.StringIO())
    assert (
        ApiToken.objects.get(name="plain").role == "trainer"
        and ApiToken.objects.get(name="plain").project.name == "default"
    )
    with pytest.raises(CommandError):
        call_command("create_token", "ci", stdout=io.StringIO())
    listed = io.StringIO()
    call_command("list_tokens", "--project", "newproj", stdout=listed)
    assert "ci" in listed.getvalue() and "plain" not in listed.getvalue() and key not in listed.getvalue()
    call_command("revoke_token", "ci", stdout=io.StringIO())
    listed = io.StringIO()
    call_command("list_tokens", stdout=listed)
    assert "revoked" in listed.getvalue() and "plain" in listed.getvalue()
    with pytest.raises(CommandError):
        call_command("revoke_token", "ci", stdout=io.StringIO())

    django_user_model.objects.create_user("carol")
    call_command(
        "project_set",
        "newproj",
        "--network",
        "on",
        "--images",
        "tvcache/busybox:latest",
        "--max-memory-mb",
        "256",
        "--max-live-sandboxes",
        "3",
        "--max-snapshot-bytes",
        "2G",
        "--rate-limit",
        "50",
        "--member",
        "carol:maintainer",
        stdout=io.StringIO(),
    )
    project = Project.objects.get(name="newproj")
    assert (project.network, project.images, project.max_memory_mb, project.max_live_sandboxes) == (
        True,
        ["tvcache/busybox:latest"],
        256,
        3,
    )
    assert (project.max_snapshot_bytes, project.rate_limit) == (2 * 2**30, 50)
    assert Membership.objects.get(project=project, user__username="carol").role == "maintainer"
    call_command("project_set", "newproj", "--max-memory-mb", "none", "--remove-member", "carol", stdout=io.StringIO())
    project.refresh_from_db()
    assert project.max_memory_mb is None and project.max_live_sandboxes == 3  # only what was named changed
    assert not Membership.objects.filter(project=project).exists()
    with pytest.raises(CommandError, match="service's maximum"):
        call_command("project_set", "newproj", "--max-memory-mb", "999999", stdout=io.StringIO())
    with pytest.raises(CommandError, match="runs no image"):
        call_command("project_set", "newproj", "--images", "evil/image", stdout=io.StringIO())
