"""Determinism audit in the store: the task's audit rate, hits marked for audit, the client-mode
report, divergent nodes no longer served, the per-tool limit and the stats."""

from __future__ import annotations

import pytest

from cache.models import AuditEntry, Divergence, Node, Task
from cache.services import divergence_record
from tests.support.api import call, lookup, record

pytestmark = pytest.mark.django_db

W = call("write", path="f", content="1")
R = call("read", path="f")
ROLL = call("roll", sides=6)


def put(api, task: str, **body):
    return api.put(
        f"/api/v1/tasks/{task}",
        {
            "env": {"backend": "external", "name": task},
            "tools": {"read": {"mutates_state": False}, "roll": {"mutates_state": False}},
            **body,
        },
        format="json",
    )


def audit(api, task: str, node_id: int, result, **extra):
    return api.post(f"/api/v1/tasks/{task}/nodes/{node_id}/audit", {"result": result, **extra}, format="json")


@pytest.mark.parametrize("rate", [-0.1, 1.01, "0.5", True, [0.1]])
def test_audit_rate_out_of_range_is_400(api, rate):
    response = put(api, "rates", audit_rate=rate)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_payload"
    assert response.json()["error"]["details"] == {"field": "audit_rate"}
    assert not Task.objects.filter(pk="rates").exists()


def test_audit_rate_defaults_and_changing_it_keeps_the_graph(api, settings):
    settings.TVCACHE = {**settings.TVCACHE, "DEFAULT_AUDIT_RATE": 0.02}
    assert Task._meta.get_field("audit_rate").default == 0.02
    created = put(api, "keep")
    assert created.status_code == 201 and created.json()["audit_rate"] == 0.02
    assert created.json()["uncacheable_tools"] == []
    node = record(api, "keep", [], W, {"ok": True})["node_id"]
    for rate in (0, 1, 0.5):
        changed = put(api, "keep", audit_rate=rate)
        assert changed.status_code == 200 and changed.json()["audit_rate"] == rate
    assert lookup(api, "keep", [], W)["node_id"] == node  # still a hit: the graph stayed


def test_a_sampled_hit_says_audit_and_costs_no_statement(api, django_assert_num_queries):
    put(api, "sampled", audit_rate=1.0)
    node = record(api, "sampled", [], W, {"ok": True})["node_id"]
    lookup(api, "sampled", [], W)  # token and task handle cached
    with django_assert_num_queries(1):
        hit = lookup(api, "sampled", [], W, rollout_id="r")
    assert hit == {"hit": True, "node_id": node, "mutates": True, "audit": True, "result": {"ok": True}}
    put(api, "sampled", audit_rate=0.0)
    lookup(api, "sampled", [], W)
    with django_assert_num_queries(1):
        assert "audit" not in lookup(api, "sampled", [], W, rollout_id="r")


def test_a_client_report_that_differs_makes_the_node_a_miss(api):
    put(api, "client")
    record(api, "client", [], W, {"ok": True})
    node = record(api, "client", [W], ROLL, {"value": 3}, rollout_id="r1")["node_id"]
    same = audit(api, "client", node, {"value": 3}, rollout_id="r2")
    assert same.status_code == 200 and same.json() == {"divergent": False}
    assert lookup(api, "client", [W], ROLL)["hit"] is True

    other = audit(api, "client", node, {"value": 5}, rollout_id="r2")
    assert other.status_code == 200 and other.json() == {"divergent": True}
    divergence = Divergence.objects.get(node_id=node)
    assert (divergence.kind, divergence.tool, divergence.rollout_id) == ("audit", "roll", "r2")
    assert (divergence.expected, divergence.observed) == ({"value": 3}, {"value": 5})
    # No longer served: a miss with its match (the write before it is still cached), and no claim.
    miss = lookup(api, "client", [W], ROLL, rollout_id="r3", claim=True)
    assert miss["hit"] is False and miss["matched"] == 1 and "claim" not in miss
    # Recording it again is idempotent; it stays a miss.
    assert record(api, "client", [W], ROLL, {"value": 6})["node_id"] == node
    assert lookup(api, "client", [W], ROLL)["hit"] is False
    assert lookup(api, "client", [], W)["hit"] is True  # the rest of the graph is served
    assert api.get("/api/v1/tasks/client/graph").json()["nodes"][1]["divergent"] is True


def test_nothing_below_a_divergent_state_changing_node_is_served(api, django_assert_num_queries):
    put(api, "below")
    w2 = call("write", path="g", content="2")
    write = record(api, "below", [], W, {"ok": True})["node_id"]
    record(api, "below", [W], R, {"output": "1"})
    record(api, "below", [W, R], w2, {"ok": True})
    other = record(api, "below", [], w2, {"ok": True})["node_id"]
    assert audit(api, "below", write, {"ok": False}).json() == {"divergent": True}
    # The state after the write is not a function of the history any more: a rollout that ran it
    # itself may hold anything, so the read after it and everything deeper is executed again.
    lookup(api, "below", [], w2)
    with django_assert_num_queries(1):
        deeper = lookup(api, "below", [W, R], w2)
    assert deeper["hit"] is False and deeper["matched"] == 2  # the match (and its snapshots) stays
    assert lookup(api, "below", [W], R)["hit"] is False
    assert lookup(api, "below", [], w2)["node_id"] == other  # another branch is served


def test_the_audit_endpoint_refuses_bad_input(api):
    put(api, "bad")
    node = record(api, "bad", [], W, {"ok": True})["node_id"]
    assert audit(api, "bad", 999999, {"ok": True}).json()["error"]["code"] == "unknown_node"
    assert audit(api, "bad", 999999, {"ok": True}).status_code == 404
    missing = api.post(f"/api/v1/tasks/bad/nodes/{node}/audit", {}, format="json")
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "invalid_payload"
    assert api.post("/api/v1/tasks/nope/nodes/1/audit", {"result": {}}, format="json").status_code == 404
    null = api.post(f"/api/v1/tasks/bad/nodes/{node}/audit", {"result": None}, format="json")
    assert null.status_code == 400 and null.json()["error"]["code"] == "invalid_payload"


def test_a_tool_with_more_divergent_nodes_than_the_limit_becomes_uncacheable(api, settings):
    settings.TVCACHE = {**settings.TVCACHE, "AUDIT_MAX_DIVERGENT": 3}
    put(api, "limit")
    nodes = [record(api, "limit", [], call("roll", seed=i), {"value": i})["node_id"] for i in range(6)]
    write = record(api, "limit", [], W, {"ok": True})["node_id"]
    for node in nodes[:3]:
        assert audit(api, "limit", node, {"value": -1}).json() == {"divergent": True}
    assert Task.objects.get(pk="limit").uncacheable_tools == []  # 3 is not more than 3
    assert lookup(api, "limit", [], call("roll", seed=4))["hit"] is True
    assert not AuditEntry.objects.filter(task_id="limit").exists()

    assert audit(api, "limit", nodes[3], {"value": -1}).json() == {"divergent": True}
    task = api.get("/api/v1/tasks/limit").json()
    assert task["uncacheable_tools"] == ["roll"]
    # Every roll is executed now, divergent or not; other tools are still served.
    assert lookup(api, "limit", [], call("roll", seed=4))["hit"] is False
    assert lookup(api, "limit", [], W)["node_id"] == write
    entry = AuditEntry.objects.get(task_id="limit")
    assert (entry.action, entry.outcome, entry.actor_name) == ("tool_uncacheable", "ok", "tvcache")
    assert entry.details == {"tool": "roll", "divergent_nodes": 4, "limit": 3}
    # A fifth divergent node changes nothing more: one entry.
    assert audit(api, "limit", nodes[4], {"value": -1}).json() == {"divergent": True}
    assert AuditEntry.objects.filter(task_id="limit").count() == 1
    assert put(api, "limit", audit_rate=0.5).json()["uncacheable_tools"] == ["roll"]  # a PUT keeps the verdict
    # A new environment starts a new graph, with a clean audit.
    renewed = api.put("/api/v1/tasks/limit", {"env": {"backend": "external", "name": "limit-2"}}, format="json")
    assert renewed.json()["uncacheable_tools"] == []
    assert not Divergence.objects.filter(task_id="limit").exists()


def test_stats_report_divergences_per_tool_and_per_node(api):
    put(api, "stats")
    write = record(api, "stats", [], W, {"ok": True})["node_id"]
    roll = record(api, "stats", [W], ROLL, {"value": 1})["node_id"]
    audit(api, "stats", roll, {"value": 2}, rollout_id="r2")
    audit(api, "stats", roll, {"value": 4}, rollout_id="r3")
    # A sandbox materialized for the write was not in its state: counted, the node stays served.
    divergence_record(
        task_id="stats",
        node_id=write,
        tool="write",
        kind="state",
        expected={"digest": "a"},
        observed={"digest": "b"},
        rollout_id="r4",
    )
    assert Node.objects.get(pk=write).divergent is False
    divergences = api.get("/api/v1/tasks/stats/stats").json()["divergences"]
    assert divergences["count"] == 3 and divergences["divergent_nodes"] == 1
    assert divergences["uncacheable_tools"] == []
    assert divergences["per_tool"] == [
        {"tool": "roll", "count": 2, "audit": 2, "state": 0, "divergent_nodes": 1, "uncacheable": False},
        {"tool": "write", "count": 1, "audit": 0, "state": 1, "divergent_nodes": 0, "uncacheable": False},
    ]
    per_node = {row["node_id"]: row for row in divergences["per_node"]}
    assert per_node[roll]["count"] == 2 and per_node[roll]["divergent"] is True and per_node[roll]["call"] == ROLL
    assert per_node[write]["state"] == 1 and per_node[write]["divergent"] is False
    assert api.get("/api/v1/tasks/stats").json()["stats"]["divergences"]["count"] == 3


def test_divergence_record_refuses_an_unknown_kind(api):
    put(api, "kinds")
    with pytest.raises(ValueError):
        divergence_record(task_id="kinds", node_id=None, tool="x", kind="guess", expected=1, observed=2)
