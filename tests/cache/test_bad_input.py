"""Every kind of bad input answers a 4xx with its own stable code and writes nothing."""

import io

import pytest
from django.core.management import call_command
from django.test import override_settings
from rest_framework.test import APIClient

from cache.inputs import MAX_FILE_TIMES, MAX_FILE_TIMES_PATHS
from cache.models import Lease, Node, ToolStat
from sandboxes.handles import sandbox_config
from tests.support.api import call
from tvclient import executor as tvclient_executor

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
    assert (
        error(api.post("/api/v1/tasks/toy/lookup", {"history": "x", "call": W}, format="json"), 400)
        == "invalid_payload"
    )


def test_wrong_type_of_epoch(api, toy_task):
    body = {"history": [], "call": W, "epoch": "one"}
    assert error(api.post("/api/v1/tasks/toy/lookup", body, format="json"), 400) == "invalid_payload"


def test_call_with_non_object_args(api, toy_task):
    response = api.post(
        "/api/v1/tasks/toy/record",
        {"history": [{"tool": "x", "args": [1]}], "call": W, "result": {}, "exec_ms": 1},
        format="json",
    )
    assert error(response, 400) == "invalid_call"
    assert response.json()["error"]["details"] == {"field": "history[0].args"}
    assert ToolStat.objects.count() == 0


def test_call_without_tool(api, toy_task):
    assert (
        error(api.post("/api/v1/tasks/toy/lookup", {"history": [], "call": {"args": {}}}, format="json"), 400)
        == "invalid_call"
    )


def test_negative_exec_ms(api, toy_task):
    body = {"history": [], "call": W, "result": {}, "exec_ms": -1}
    assert error(api.post("/api/v1/tasks/toy/record", body, format="json"), 400) == "invalid_payload"
    assert Node.objects.count() == 0


def test_unknown_task(api):
    assert (
        error(api.post("/api/v1/tasks/nope/lookup", {"history": [], "call": W}, format="json"), 404) == "unknown_task"
    )


@override_settings(
    TVCACHE={"MAX_RESULT_BYTES": 100, "MAX_HISTORY": 10_000, "LEASE_TTL_S": 60, "DEFAULT_SANDBOX_BUDGET": 4}
)
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
    assert (
        error(APIClient().post("/api/v1/tasks/toy/lookup", {"history": [], "call": W}, format="json"), 401)
        == "not_authenticated"
    )


def test_wrong_token(toy_task):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token wrong")
    assert (
        error(client.post("/api/v1/tasks/toy/lookup", {"history": [], "call": W}, format="json"), 401)
        == "invalid_token"
    )


def test_unknown_backend(api):
    assert error(api.put("/api/v1/tasks/t", {"env": {"backend": "vm"}}, format="json"), 400) == "unknown_backend"


def test_bad_tool_policy(api):
    response = api.put("/api/v1/tasks/t", {"env": {}, "tools": {"bash": {"mutates_state": "no"}}}, format="json")
    assert error(response, 400) == "invalid_payload"


def test_snapshot_of_unknown_node(api, toy_task):
    response = api.post("/api/v1/tasks/toy/nodes/999/snapshots", {"ref": "r", "backend": "external"}, format="json")
    assert error(response, 404) == "unknown_node"


def test_snapshot_without_ref(api, toy_task):
    assert (
        error(api.post("/api/v1/tasks/toy/nodes/1/snapshots", {"backend": "external"}, format="json"), 400)
        == "invalid_payload"
    )


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
    assert (
        error(api.post(path, {"history": [], "call": {"args": {}}, "rollout_id": "r"}, format="json"), 400)
        == "invalid_call"
    )
    assert (
        error(
            api.post("/api/v1/tasks/nope/claims/release", {"history": [], "call": W, "rollout_id": "r"}, format="json"),
            404,
        )
        == "unknown_task"
    )
    body = {"history": [], "call": W, "claim": "yes", "rollout_id": "r"}
    assert error(api.post("/api/v1/tasks/toy/lookup", body, format="json"), 400) == "invalid_payload"


# --- input validated at the edge: NUL, lone surrogates, nesting, ranges, id lengths ---


def nested(levels: int) -> str:
    """JSON text of `levels` nested arrays (built as text: encoders stop short of 600)."""
    return "[" * levels + "]" * levels


def raw(api, path, text: str):
    return api.generic("POST", path, text.encode(), content_type="application/json")


@pytest.mark.parametrize("endpoint", ["lookup", "record"])
@pytest.mark.parametrize("where", ["args value", "args key", "tool", "history", "rollout_id"])
def test_nul_anywhere_in_a_call_is_refused(api, toy_task, endpoint, where):
    bad = {
        "args value": call("write", path="f\x00", content="1"),
        "args key": {"tool": "write", "args": {"p\x00": 1}},
        "tool": call("wri\x00te", path="f"),
    }
    body = {
        "history": [bad["args value"]] if where == "history" else [],
        "call": bad.get(where, W),
        "result": {},
        "exec_ms": 1,
        **({"rollout_id": "r\x00"} if where == "rollout_id" else {}),
    }
    response = api.post(f"/api/v1/tasks/toy/{endpoint}", body, format="json")
    assert error(response, 400) == "invalid_string"
    assert Node.objects.count() == 0


def test_a_lookup_with_nul_in_the_tool_name_does_not_lose_the_counters_of_others(api, toy_task):
    from tests.support.api import lookup, record

    record(api, "toy", [], W, {"ok": True})
    bad = api.post("/api/v1/tasks/toy/lookup", {"history": [], "call": call("wri\x00te", path="f")}, format="json")
    assert error(bad, 400) == "invalid_string"
    assert lookup(api, "toy", [], W, rollout_id="r1")["hit"] is True
    stats = api.get("/api/v1/tasks/toy/stats").json()  # flushes the counters first
    assert (stats["calls"], stats["hits"]) == (1, 1)


def test_a_result_may_hold_nul(api, toy_task):
    # A tool's output may be binary; results are stored as JSON text, where NUL is escaped.
    body = {"history": [], "call": W, "result": {"stdout": "a\x00b"}, "exec_ms": 1}
    assert api.post("/api/v1/tasks/toy/record", body, format="json").status_code == 200
    hit = api.post("/api/v1/tasks/toy/lookup", {"history": [], "call": W}, format="json").json()
    assert hit["result"] == {"stdout": "a\x00b"}


@pytest.mark.parametrize("endpoint", ["lookup", "record", "claims/release"])
def test_a_lone_surrogate_is_refused(api, toy_task, endpoint):
    text = '{"history": [], "call": {"tool": "write", "args": {"path": "\\ud800"}}, "result": {}, "exec_ms": 1, "rollout_id": "r"}'
    assert error(raw(api, f"/api/v1/tasks/toy/{endpoint}", text), 400) == "invalid_string"


@pytest.mark.parametrize("endpoint,field", [("lookup", "args"), ("record", "args"), ("record", "result")])
def test_nesting_600_deep_is_refused(api, toy_task, endpoint, field):
    args = nested(600) if field == "args" else "{}"
    result = nested(600) if field == "result" else "{}"
    text = f'{{"history": [], "call": {{"tool": "write", "args": {{"x": {args}}}}}, "result": {result}, "exec_ms": 1}}'
    response = raw(api, f"/api/v1/tasks/toy/{endpoint}", text)
    assert error(response, 400) == "nesting_too_deep"
    assert response.json()["error"]["details"]["limit"] == 64
    assert Node.objects.count() == 0


def test_nesting_beyond_what_json_parsing_allows_is_refused_too(api, toy_task):
    text = '{"history": [], "call": {"tool": "write", "args": {"x": %s}}}' % nested(1100)
    assert error(raw(api, "/api/v1/tasks/toy/lookup", text), 400) == "nesting_too_deep"


def test_the_nesting_limit_is_a_setting_and_counts_from_the_args(api, toy_task, settings):
    settings.TVCACHE = {**settings.TVCACHE, "MAX_JSON_DEPTH": 3}
    ok = {"history": [call("write", x=[[1]])], "call": call("write", x=[[1]]), "result": [[[1]]], "exec_ms": 1}
    assert api.post("/api/v1/tasks/toy/record", ok, format="json").status_code == 200  # args, list, list: 3 levels
    deep = {"history": [call("write", x=[[[1]]])], "call": W}
    assert error(api.post("/api/v1/tasks/toy/lookup", deep, format="json"), 400) == "nesting_too_deep"


@pytest.mark.parametrize("epoch", [2**40, -(2**31) - 1, True, 1.5])
def test_an_epoch_beyond_its_column_is_refused(api, toy_task, epoch):
    for endpoint in ("lookup", "record"):
        body = {"history": [], "call": W, "result": {}, "exec_ms": 1, "epoch": epoch}
        response = api.post(f"/api/v1/tasks/toy/{endpoint}", body, format="json")
        assert error(response, 400) == "invalid_payload"
        assert response.json()["error"]["details"]["field"] == "epoch"
    assert ToolStat.objects.count() == 0


def test_the_extreme_epochs_of_the_column_are_accepted(api, toy_task):
    from tests.support.api import record

    for epoch in (2**31 - 1, -(2**31)):
        record(api, "toy", [], W, {"ok": True}, epoch=epoch)
    assert api.get("/api/v1/tasks/toy/stats").status_code == 200


@pytest.mark.parametrize("exec_ms", [1e11, 1e308])
def test_an_exec_time_beyond_the_cap_is_refused(api, toy_task, exec_ms):
    body = {"history": [], "call": W, "result": {}, "exec_ms": exec_ms}
    assert error(api.post("/api/v1/tasks/toy/record", body, format="json"), 400) == "invalid_payload"


@pytest.mark.parametrize("number", ["1e300", "-1e19", "9223372036854775808.0"])
def test_numbers_that_jsonb_would_give_back_beyond_64_bits_are_refused(api, toy_task, number):
    text = '{"history": [], "call": {"tool": "write", "args": {"n": %s}}, "result": {}, "exec_ms": 1}' % number
    assert error(raw(api, "/api/v1/tasks/toy/record", text), 400) == "invalid_payload"
    response = api.generic(
        "PUT",
        "/api/v1/tasks/t",
        ('{"env": {"backend": "external", "n": %s}}' % number).encode(),
        content_type="application/json",
    )
    assert error(response, 400) == "invalid_payload"


def test_the_largest_integers_are_stored_and_given_back(api, toy_task):
    env = {"backend": "external", "big": 2**64 - 1, "small": -(2**63), "float": 9.2e18}
    assert api.put("/api/v1/tasks/big", {"env": env}, format="json").status_code == 201
    assert api.get("/api/v1/tasks/big").json()["env"]["big"] == 2**64 - 1


def test_a_task_id_longer_than_its_column_is_refused(api):
    response = api.put(f"/api/v1/tasks/{'t' * 201}", {"env": {"backend": "external"}}, format="json")
    assert error(response, 400) == "invalid_id"
    assert api.put(f"/api/v1/tasks/{'t' * 200}", {"env": {"backend": "external"}}, format="json").status_code == 201
    assert error(api.get(f"/api/v1/tasks/{'t' * 300}"), 404) == "unknown_task"


def test_a_rollout_id_longer_than_its_column_is_refused(api, toy_task):
    body = {"history": [], "call": W, "rollout_id": "r" * 201}
    assert error(api.post("/api/v1/tasks/toy/lookup", body, format="json"), 400) == "invalid_id"
    path = f"/api/v1/tasks/toy/rollouts/{'r' * 201}/calls"
    assert error(api.post(path, {"call": W}, format="json"), 400) == "invalid_id"
    assert error(api.post("/api/v1/tasks/toy/rollouts/r%00/calls", {"call": W}, format="json"), 400) == "invalid_string"


def test_nul_in_a_task_env_or_tool_name_is_refused(api):
    for body in (
        {"env": {"backend": "external", "x": "a\x00"}},
        {"env": {"backend": "external"}, "tools": {"b\x00sh": {"mutates_state": False}}},
    ):
        assert error(api.put("/api/v1/tasks/t", body, format="json"), 400) == "invalid_string"


def test_a_sandbox_budget_beyond_its_column_is_refused(api):
    response = api.put("/api/v1/tasks/t", {"env": {}, "sandbox_budget": 2**31}, format="json")
    assert error(response, 400) == "invalid_payload"


@pytest.mark.parametrize("query", ["offset=9999999999999999999999", "offset=2147483648", "limit=99999999999999999999"])
def test_paging_beyond_range_is_refused(api, toy_task, query):
    assert error(api.get(f"/api/v1/tasks?{query}"), 400) == "invalid_payload"


def test_a_search_with_nul_is_refused(api, toy_task):
    assert error(api.get("/api/v1/tasks?q=to%00y"), 400) == "invalid_string"


def test_node_ids_beyond_their_column_are_refused(api, toy_task):
    huge = 2**63
    body = {"ref": "r", "backend": "external"}
    assert error(api.post(f"/api/v1/tasks/toy/nodes/{huge}/snapshots", body, format="json"), 400) == "invalid_id"
    assert error(api.get(f"/api/v1/tasks/toy/graph?root={huge}"), 400) == "invalid_payload"
    assert error(api.get("/api/v1/tasks/toy/graph?depth=99999999999"), 400) == "invalid_payload"


def test_snapshot_sizes_and_times_beyond_their_caps_are_refused(api, toy_task):
    from tests.support.api import record

    node = record(api, "toy", [], W, {"ok": True})["node_id"]
    for extra in ({"size_bytes": 2**63}, {"size_bytes": 2**41}, {"create_ms": 1e300}):
        response = api.post(
            f"/api/v1/tasks/toy/nodes/{node}/snapshots", {"ref": "r", "backend": "external", **extra}, format="json"
        )
        assert error(response, 400) == "invalid_payload"


@pytest.mark.parametrize("restore_ms", ["nan", "inf", "-1", "1e300"])
def test_a_lease_release_with_an_impossible_restore_time_is_refused(api, toy_task, restore_ms):
    path = f"/api/v1/leases/6f1c1d3e-0000-4000-8000-000000000000?restore_ms={restore_ms}"
    assert error(api.delete(path), 400) == "invalid_payload"


@pytest.mark.parametrize(
    "file_times, code",
    [
        ([1], "invalid_payload"),  # not an object
        ("f", "invalid_payload"),
        ({"f": -1}, "invalid_payload"),  # before the epoch
        ({"f": 2**63}, "invalid_payload"),  # beyond a 64-bit integer
        ({"f": 1.5}, "invalid_payload"),  # not an integer
        ({"f": True}, "invalid_payload"),
        ({"f": "1"}, "invalid_payload"),
        ({"f": None}, "invalid_payload"),
        ({"": 1}, "invalid_payload"),  # no path
        ({"x" * 4097: 1}, "invalid_payload"),  # longer than PATH_MAX
        ({"f\x00": 1}, "invalid_string"),
        ({f"f{i}": 1 for i in range(20_001)}, "invalid_payload"),  # more entries than a node keeps
    ],
)
def test_a_record_with_impossible_file_times_is_refused(api, toy_task, file_times, code):
    body = {"history": [], "call": W, "result": {}, "exec_ms": 1, "file_times": file_times}
    response = api.post("/api/v1/tasks/toy/record", body, format="json")
    assert error(response, 400) == code
    assert response.json()["error"]["details"]["field"].startswith("file_times")
    assert Node.objects.count() == 0


def test_a_record_with_more_than_4_mib_of_file_times_paths_is_refused(api, toy_task, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 8 << 20  # above the default body limit (2.5 MB)
    body = {
        "history": [],
        "call": W,
        "result": {},
        "exec_ms": 1,
        "file_times": {f"{i}".rjust(4096, "x"): 1 for i in range(1_025)},
    }
    response = api.post("/api/v1/tasks/toy/record", body, format="json")
    assert error(response, 400) == "invalid_payload"
    assert response.json()["error"]["details"]["max_total"] == 4 << 20


def test_a_record_with_file_times_at_their_limits_is_stored(api, toy_task):
    # what the service keeps of its own sandboxes' calls, and what tvclient sends at most
    limits = (MAX_FILE_TIMES, MAX_FILE_TIMES_PATHS)
    assert limits == sandbox_config().docker.file_times_max == (20_000, 4 << 20)
    assert limits == (tvclient_executor.MAX_FILE_TIMES, tvclient_executor.MAX_FILE_TIMES_PATHS)
    times = {f"p{i}": 2**63 - 1 for i in range(19_999)} | {"x" * 4096: 0}
    body = {"history": [], "call": W, "result": {}, "exec_ms": 1, "file_times": times}
    assert api.post("/api/v1/tasks/toy/record", body, format="json").status_code == 200
    assert Node.objects.get().file_times == times


def test_file_times_refuses_bad_input(api, toy_task):
    path = "/api/v1/tasks/toy/file-times"
    assert error(post(api, path, "{not json"), 400) == "malformed_json"
    assert error(api.post(path, {"history": [W], "call": W}, format="json"), 400) == "missing_field"
    assert error(api.post(path, {"history": [W], "call": W, "replay": W}, format="json"), 400) == "invalid_payload"
    assert (
        error(api.post(path, {"history": [W], "call": W, "replay": [{"args": {}}]}, format="json"), 400)
        == "invalid_call"
    )
    assert (
        error(api.post("/api/v1/tasks/nope/file-times", {"history": [], "call": W, "replay": []}, format="json"), 404)
        == "unknown_task"
    )
