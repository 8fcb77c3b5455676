"""Every kind of bad input answers a 4xx with its own stable code and writes nothing."""

import io

import pytest
from django.core.management import call_command
from django.test import override_settings
from rest_framework.test import APIClient

from cache.models import Lease, Node, ToolStat

from .helpers import call

W = call("write", path="f", content="1")


def error(response, status):
    assert response.status_code == status, response.content
    return response.json()["error"]["code"]


@pytest.fixture(autouse=True)
def nothing_written(db):
    yield
    assert Node.objects.count() == 0 or Node.objects.filter(tool="write", call__args__content="1").count() <= 1


def post(api, path, body):
    return api.post(path, body, content_type="application/json")


def test_malformed_json(api, toy_task):
    assert error(post(api, "/api/v1/tasks/toy/lookup", "{not json"), 400) == "malformed_json"


def test_body_not_an_object(api, toy_task):
    assert error(api.post("/api/v1/tasks/toy/lookup", [1, 2], format="json"), 400) == "invalid_payload"


def test_missing_field(api, toy_task):
    response = api.post("/api/v1/tasks/toy/lookup", {"call": W}, format="json")
    assert error(response, 400) == "missing_field"
    assert response.json()["error"]["details"] == {"field": "history"}


def test_wrong_type_of_history(api, toy_task):
    assert error(api.post("/api/v1/tasks/toy/lookup", {"history": "x", "call": W}, format="json"), 400) == "invalid_payload"


def test_wrong_type_of_epoch(api, toy_task):
    body = {"history": [], "call": W, "epoch": "one"}
    assert error(api.post("/api/v1/tasks/toy/lookup", body, format="json"), 400) == "invalid_payload"


def test_call_with_non_object_args(api, toy_task):
    response = api.post("/api/v1/tasks/toy/record", {"history": [{"tool": "x", "args": [1]}], "call": W,
                                                     "result": {}, "exec_ms": 1}, format="json")
    assert error(response, 400) == "invalid_call"
    assert response.json()["error"]["details"] == {"field": "history[0].args"}
    assert ToolStat.objects.count() == 0


def test_call_without_tool(api, toy_task):
    assert error(api.post("/api/v1/tasks/toy/lookup", {"history": [], "call": {"args": {}}}, format="json"), 400) == "invalid_call"


def test_negative_exec_ms(api, toy_task):
    body = {"history": [], "call": W, "result": {}, "exec_ms": -1}
    assert error(api.post("/api/v1/tasks/toy/record", body, format="json"), 400) == "invalid_payload"
    assert Node.objects.count() == 0


def test_unknown_task(api):
    assert error(api.post("/api/v1/tasks/nope/lookup", {"history": [], "call": W}, format="json"), 404) == "unknown_task"


@override_settings(TVCACHE={"MAX_RESULT_BYTES": 100, "MAX_HISTORY": 10_000, "LEASE_TTL_S": 60, "DEFAULT_SANDBOX_BUDGET": 4})
def test_result_over_the_size_cap(api, toy_task):
    body = {"history": [], "call": W, "result": {"stdout": "x" * 200}, "exec_ms": 1}
    assert error(api.post("/api/v1/tasks/toy/record", body, format="json"), 413) == "result_too_large"
    assert Node.objects.count() == 0 and ToolStat.objects.count() == 0


def test_result_over_the_default_cap_of_one_mebibyte(api, toy_task):
    body = {"history": [], "call": W, "result": {"stdout": "x" * (1024 * 1024)}, "exec_ms": 1}
    assert error(api.post("/api/v1/tasks/toy/record", body, format="json"), 413) == "result_too_large"


def test_history_over_the_length_cap(api, toy_task):
    body = {"history": [W] * 10_001, "call": W}
    assert error(api.post("/api/v1/tasks/toy/lookup", body, format="json"), 413) == "history_too_long"


def test_resume_must_be_a_boolean(api, toy_task):
    response = api.post("/api/v1/tasks/toy/lookup", {"history": [], "call": W, "resume": "no"}, format="json")
    assert error(response, 400) == "invalid_payload"
    assert response.json()["error"]["details"] == {"field": "resume"}


def test_unknown_lease(api, toy_task):
    assert error(api.delete("/api/v1/leases/6f1c1d3e-0000-4000-8000-000000000000"), 404) == "unknown_lease"
    assert error(api.delete("/api/v1/leases/not-a-uuid"), 404) == "unknown_lease"
    assert Lease.objects.count() == 0


def test_missing_token(toy_task):
    assert error(APIClient().post("/api/v1/tasks/toy/lookup", {"history": [], "call": W}, format="json"), 401) == "not_authenticated"


def test_wrong_token(toy_task):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token wrong")
    assert error(client.post("/api/v1/tasks/toy/lookup", {"history": [], "call": W}, format="json"), 401) == "invalid_token"


def test_unknown_backend(api):
    assert error(api.put("/api/v1/tasks/t", {"env": {"backend": "vm"}}, format="json"), 400) == "unknown_backend"


def test_bad_tool_policy(api):
    response = api.put("/api/v1/tasks/t", {"env": {}, "tools": {"bash": {"mutates_state": "no"}}}, format="json")
    assert error(response, 400) == "invalid_payload"


def test_snapshot_of_unknown_node(api, toy_task):
    response = api.post("/api/v1/tasks/toy/nodes/999/snapshots", {"ref": "r", "backend": "external"}, format="json")
    assert error(response, 404) == "unknown_node"


def test_snapshot_without_ref(api, toy_task):
    assert error(api.post("/api/v1/tasks/toy/nodes/1/snapshots", {"backend": "external"}, format="json"), 400) == "invalid_payload"


def test_unknown_route_is_json_404(api):
    assert error(api.get("/api/v1/nothing-here"), 404) == "not_found"


def test_wrong_method(api, toy_task):
    assert error(api.get("/api/v1/tasks/toy/lookup"), 405) == "method_not_allowed"


def test_create_token_prints_a_key_that_authenticates(toy_task):
    out = io.StringIO()
    call_command("create_token", "trainer-1", stdout=out)
    key = out.getvalue().strip()
    assert key.startswith("tvc_")  # never "-": a command line would take "--token -x..." for an option
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    assert client.get("/api/v1/tasks/toy").status_code == 200


def test_claim_release_refuses_bad_input(api, toy_task):
    path = "/api/v1/tasks/toy/claims/release"
    assert error(post(api, path, "{not json"), 400) == "malformed_json"
    assert error(api.post(path, {"history": [], "call": {"args": {}}, "rollout_id": "r"}, format="json"), 400) == "invalid_call"
    assert error(api.post("/api/v1/tasks/nope/claims/release", {"history": [], "call": W, "rollout_id": "r"},
                          format="json"), 404) == "unknown_task"
    body = {"history": [], "call": W, "claim": "yes", "rollout_id": "r"}
    assert error(api.post("/api/v1/tasks/toy/lookup", body, format="json"), 400) == "invalid_payload"
