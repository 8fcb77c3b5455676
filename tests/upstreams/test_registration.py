"""Registering an upstream: PUT validates with stable error codes, the answer carries the proxy
path (a secret), GET reports the configuration with the counters."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from upstreams.models import Upstream

pytestmark = pytest.mark.django_db

VALID = {"protocol": "verl-tool", "url": "http://127.0.0.1:5000/get_observation", "task_fields": ["task_id"]}


def put(api, name, body):
    return api.put(f"/api/v1/upstreams/{name}", body, format="json")


def test_put_creates_then_updates_and_keeps_the_proxy_path(api):
    created = put(api, "sql", {**VALID, "action_pattern": r"<sql>(.*?)</sql>", "ignore_fields": ["gt_sql"]})
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["proxy_path"].startswith("/verl-tool/") and body["proxy_path"].endswith("/get_observation")
    assert body["proxy_url"] == "http://testserver" + body["proxy_path"]
    assert (body["read_only"], body["ignore_fields"], body["timeout_s"]) == (False, ["gt_sql"], 120.0)
    secret = body["proxy_path"].split("/")[2]
    assert len(secret) >= 32
    row = Upstream.objects.get(name="sql")
    assert secret not in {row.secret_digest, row.secret_nonce}  # only a digest of it is stored
    updated = put(api, "sql", {**VALID, "read_only": True})
    assert updated.status_code == 200
    assert updated.json()["proxy_path"] == body["proxy_path"] and updated.json()["action_pattern"] == ""
    got = api.get("/api/v1/upstreams/sql").json()
    assert got["proxy_path"] == body["proxy_path"] and got["read_only"] is True
    assert {
        k: got[k] for k in ("hits", "misses", "passed_through", "upstream_requests", "upstream_errors", "trajectories")
    } == dict.fromkeys(("hits", "misses", "passed_through", "upstream_requests", "upstream_errors", "trajectories"), 0)


def test_rotating_the_secret_retires_the_old_proxy_path(api, client):
    old = put(api, "rot", VALID).json()["proxy_path"]
    new = put(api, "rot", {**VALID, "rotate_secret": True}).json()["proxy_path"]
    assert new != old
    body = {"trajectory_ids": ["t"], "actions": [""], "finish": [True]}
    answer = client.post(old, body, content_type="application/json")
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "unknown_upstream"


@pytest.mark.parametrize(
    "body, code, field",
    [
        ([], "invalid_payload", None),
        ({"url": VALID["url"], "task_fields": []}, "missing_field", "protocol"),
        ({**VALID, "protocol": "skyrl"}, "unknown_protocol", "protocol"),
        ({**VALID, "url": "ftp://host/get_observation"}, "invalid_url", "url"),
        ({**VALID, "url": "http:///get_observation"}, "invalid_url", "url"),
        ({**VALID, "url": 5}, "invalid_url", "url"),
        ({**VALID, "action_pattern": "<sql>(.*?</sql>"}, "invalid_pattern", "action_pattern"),
        ({**VALID, "action_pattern": ["x"]}, "invalid_pattern", "action_pattern"),
        ({**VALID, "task_fields": "task_id"}, "invalid_fields", "task_fields"),
        ({**VALID, "task_fields": ["ok", 3]}, "invalid_fields", "task_fields"),
        ({**VALID, "ignore_fields": [""]}, "invalid_fields", "ignore_fields"),
        ({**VALID, "read_only": "yes"}, "invalid_payload", "read_only"),
        ({**VALID, "timeout_s": 0}, "invalid_payload", "timeout_s"),
        ({**VALID, "ignored_fields": []}, "unknown_field", "ignored_fields"),
    ],
)
def test_a_bad_registration_is_a_400_with_a_stable_code(api, body, code, field):
    response = put(api, "bad", body)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == code
    if field is not None:
        assert error["details"]["field"] == field
    assert not Upstream.objects.filter(name="bad").exists()


def test_a_name_too_long_is_a_400(api):
    response = put(api, "n" * 101, VALID)
    assert (response.status_code, response.json()["error"]["code"]) == (400, "invalid_name")


def test_upstreams_need_a_token(api):
    assert APIClient().put("/api/v1/upstreams/x", VALID, format="json").status_code == 401
    assert APIClient().get("/api/v1/upstreams/x").status_code == 401
    missing = api.get("/api/v1/upstreams/nope")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "unknown_upstream")


def test_the_proxy_path_needs_no_token_and_refuses_what_is_not_a_verl_tool_request(api, client):
    path = put(api, "shape", VALID).json()["proxy_path"]
    assert (
        client.post("/verl-tool/not-a-secret/get_observation", {}, content_type="application/json").status_code == 404
    )
    assert client.get(path).status_code == 405
    cases = [
        (b"{", "malformed_json"),
        ({"actions": ["a"]}, "missing_field"),
        ({"trajectory_ids": ["a", "b"], "actions": ["x"]}, "invalid_payload"),
        ({"trajectory_ids": ["a"], "actions": [3]}, "invalid_payload"),
        ({"trajectory_ids": ["a"], "actions": ["x"], "extra_fields": [[1]]}, "invalid_payload"),
        ({"trajectory_ids": ["a"], "actions": ["x"], "finish": ["no"]}, "invalid_payload"),
        ({"trajectory_ids": ["a" * 201], "actions": ["x"]}, "invalid_payload"),
    ]
    for body, code in cases:
        response = client.post(path, body, content_type="application/json")
        assert (response.status_code, response.json()["error"]["code"]) == (400, code), body


def test_the_openapi_schema_describes_the_upstream_routes(api):
    schema = api.get("/api/schema/?format=json").json()
    route = schema["paths"]["/api/v1/upstreams/{name}"]
    assert route["put"]["operationId"] == "v1_upstreams_put" and route["get"]["operationId"] == "v1_upstreams_get"
    assert "proxy_url" in schema["components"]["schemas"]["Upstream"]["properties"]
    assert "hits" in schema["components"]["schemas"]["UpstreamStats"]["properties"]
