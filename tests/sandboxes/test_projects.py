"""Projects in tool-server mode and the operator's sandbox grants: tool-server calls and
rollouts of another project are 404 to both roles, the same task id runs two separate graphs,
a docker env above the project's grants (network, images, limits) answers 403 with the backend's
own codes, and a project holds no more live sandboxes than it is granted (429)."""

from __future__ import annotations

import pytest

from accounts.models import Project
from sandboxes.handles import sandbox_config
from sandboxes.models import Sandbox
from tests.support.api import project_clients
from tests.support.toolserver import run

pytestmark = pytest.mark.django_db(transaction=True)

FILES = {"env": {"backend": "directory", "files": {"a.txt": "A"}}}


def read(path: str = "a.txt") -> dict:
    return {"tool": "read_file", "args": {"path": path}}


def write(path: str, content: str) -> dict:
    return {"tool": "write_file", "args": {"path": path, "content": content}}


@pytest.fixture
def clients():
    return project_clients()


def test_tool_server_calls_and_rollouts_of_another_project_are_404(clients):
    alpha = clients["alpha", "maintainer"]
    assert alpha.put("/api/v1/tasks/files", FILES, format="json").status_code == 201
    assert run(alpha, "files", "r1", write("b.txt", "alpha"))["cached"] is False
    for role in ("trainer", "maintainer"):
        beta = clients["beta", role]
        refused = beta.post("/api/v1/tasks/files/rollouts/r1/calls", {"call": read()}, format="json")
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "unknown_task"
        ended = beta.delete("/api/v1/tasks/files/rollouts/r1")
        assert ended.status_code == 404
    # Alpha's rollout still runs, in its own sandbox; a trainer of alpha may call and end it.
    trainer = clients["alpha", "trainer"]
    assert run(trainer, "files", "r1", read("b.txt"))["result"]["output"] == "alpha"
    assert trainer.delete("/api/v1/tasks/files/rollouts/r1").status_code == 204


def test_the_same_task_id_runs_two_graphs_in_tool_server_mode(clients):
    alpha, beta = clients["alpha", "trainer"], clients["beta", "trainer"]
    for client in (alpha, beta):
        assert client.put("/api/v1/tasks/files", FILES, format="json").status_code == 201
    run(alpha, "files", "r1", write("b.txt", "alpha"))
    assert run(alpha, "files", "r2", write("b.txt", "alpha"))["cached"] is True
    first = run(beta, "files", "r1", write("b.txt", "alpha"))
    assert first["cached"] is False  # beta's graph has none of alpha's nodes
    assert run(beta, "files", "r1", read("b.txt"))["result"]["output"] == "alpha"
    pools = {name: c.get("/api/v1/pools").json()["pools"] for name, c in (("alpha", alpha), ("beta", beta))}
    assert {p["task_id"] for p in pools["alpha"]} == {p["task_id"] for p in pools["beta"]} == {"files"}
    assert set(Sandbox.objects.values_list("task_id", flat=True)) == {"alpha.files", "beta.files"}


def test_a_project_holds_no_more_live_sandboxes_than_granted(clients):
    Project.objects.filter(name="alpha").update(max_live_sandboxes=1)
    client = clients["alpha", "trainer"]
    client.put("/api/v1/tasks/files", FILES, format="json")
    run(client, "files", "r1", write("b.txt", "1"))  # r1's sandbox: the project's one
    refused = client.post("/api/v1/tasks/files/rollouts/r2/calls", {"call": write("c.txt", "2")}, format="json")
    assert refused.status_code == 429 and refused["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "sandbox_quota_exceeded"
    assert run(client, "files", "r2", write("b.txt", "1"))["cached"] is True  # a hit needs no sandbox
    assert client.delete("/api/v1/tasks/files/rollouts/r1").status_code == 204
    assert run(client, "files", "r2", write("c.txt", "2"))["cached"] is False  # room again
    # Beta is not bounded by alpha's grant.
    beta = clients["beta", "trainer"]
    beta.put("/api/v1/tasks/files", FILES, format="json")
    for rollout in ("r1", "r2", "r3"):
        run(beta, "files", rollout, write(f"{rollout}.txt", rollout))
    # Pools requested for a step stay within the grant too.
    planned = client.post("/api/v1/steps", {"tasks": ["files"], "rollouts_per_task": 4}, format="json")
    assert planned.status_code == 202
    assert Sandbox.objects.filter(task_id="alpha.files").exclude(state__in=["stopped", "failed"]).count() <= 1


@pytest.fixture
def network_allowed(settings):
    """The service lets tasks have network (TVCACHE_DOCKER_ALLOW_NETWORK): projects decide."""
    settings.TVCACHE = {**settings.TVCACHE, "DOCKER_ALLOW_NETWORK": True}
    sandbox_config.cache_clear()
    yield
    sandbox_config.cache_clear()


def test_docker_envs_above_the_projects_grants_are_403(clients, busybox, network_allowed):
    Project.objects.filter(name="alpha").update(network=True)
    Project.objects.filter(name="beta").update(network=False, images=["tvcache/busybox:latest"])
    networked = {"env": {"backend": "docker", "network": True}}
    assert clients["alpha", "trainer"].put("/api/v1/tasks/net", networked, format="json").status_code == 201
    beta = clients["beta", "maintainer"]
    refused = beta.put("/api/v1/tasks/net", networked, format="json")
    assert refused.status_code == 403, refused.content
    error = refused.json()["error"]
    assert error["code"] == "network_not_granted" and error["details"]["project"] == "beta"
    assert "project 'beta'" in error["message"]
    image = beta.put(
        "/api/v1/tasks/img", {"env": {"backend": "docker", "image": "tvcache/debian:bookworm"}}, format="json"
    )
    assert image.status_code == 403 and image.json()["error"]["code"] == "image_not_allowed"
    Project.objects.filter(name="beta").update(max_memory_mb=256)
    memory = beta.put("/api/v1/tasks/mem", {"env": {"backend": "docker", "limits": {"memory_mb": 512}}}, format="json")
    assert memory.status_code == 403 and memory.json()["error"]["code"] == "limit_exceeded"
    assert memory.json()["error"]["details"]["max"] == 256
    # The service's default (512 MB) is above beta's cap too: refused until the task asks for less.
    default = beta.put("/api/v1/tasks/mem", {"env": {"backend": "docker"}}, format="json")
    assert default.status_code == 403 and default.json()["error"]["code"] == "limit_exceeded"
    assert (
        beta.put(
            "/api/v1/tasks/mem", {"env": {"backend": "docker", "limits": {"memory_mb": 256}}}, format="json"
        ).status_code
        == 201
    )
    # A grant taken back refuses the task's next sandbox (its calls that hit still answer).
    Project.objects.filter(name="alpha").update(network=False)
    call = clients["alpha", "trainer"].post(
        "/api/v1/tasks/net/rollouts/r1/calls", {"call": {"tool": "bash", "args": {"command": "true"}}}, format="json"
    )
    assert call.status_code == 403 and call.json()["error"]["code"] == "network_not_granted"
    assert not Sandbox.objects.filter(task_id="alpha.net").exists()


def test_without_the_services_allowance_no_project_has_network(clients, busybox):
    Project.objects.filter(name="alpha").update(network=True)
    refused = clients["alpha", "maintainer"].put(
        "/api/v1/tasks/net", {"env": {"backend": "docker", "network": True}}, format="json"
    )
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "network_not_granted"
    assert "TVCACHE_DOCKER_ALLOW_NETWORK" in refused.json()["error"]["message"]


def test_a_tasks_sandboxes_read_in_its_project_only(clients):
    """GET /tasks/{id}/sandboxes (what the replay reads): the sandboxes the service started for
    the task, and the live ones with the rollout each serves; another project's task is 404."""
    alpha = clients["alpha", "trainer"]
    assert alpha.put("/api/v1/tasks/files", FILES, format="json").status_code == 201
    assert alpha.get("/api/v1/tasks/files/sandboxes").json() == {"started": 0, "live": []}
    run(alpha, "files", "r1", write("b.txt", "alpha"))
    answer = alpha.get("/api/v1/tasks/files/sandboxes").json()
    row = Sandbox.objects.get(task_id="alpha.files", rollout__rollout_id="r1")
    assert {
        "id": row.pk,
        "backend": "directory",
        "pool": row.pool,
        "state": "leased",
        "rollout_id": "r1",
        "ref": row.ref,
    } in answer["live"] and row.ref
    assert answer["started"] == Sandbox.objects.filter(task_id="alpha.files", ready_at__isnull=False).count() >= 1
    assert alpha.delete("/api/v1/tasks/files/rollouts/r1").status_code == 204
    after = alpha.get("/api/v1/tasks/files/sandboxes").json()
    assert not [s for s in after["live"] if s["state"] == "leased"] and after["started"] == answer["started"]
    for role in ("trainer", "maintainer"):
        refused = clients["beta", role].get("/api/v1/tasks/files/sandboxes")
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "unknown_task"
