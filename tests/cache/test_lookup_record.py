from datetime import timedelta

import pytest
from django.apps import apps
from django.db import connection
from django.utils import timezone

from cache.models import Lease
from cache.services import claims_clear, tables_vacuum
from tests.support.api import call, lookup, record

W1, W2 = call("write", path="f", content="1"), call("write", path="f", content="2")
R = call("read", path="f")


def test_miss_then_record_then_hit(api, toy_task):
    first = lookup(api, toy_task, [], W1)
    assert first == {"hit": False, "matched": 0, "resume": None, "replay": [], "snapshot_after_ms": 100.0}
    node = record(api, toy_task, [], W1, {"ok": True}, exec_ms=100)
    assert node["created"] is True
    again = lookup(api, toy_task, [], W1)
    assert again == {"hit": True, "node_id": node["node_id"], "mutates": True, "result": {"ok": True}}


def test_a_miss_says_how_long_its_call_must_run_for_the_record_to_want_a_snapshot(api, toy_task):
    """The external backend's costs: a snapshot 50 ms, a restore 50 ms. After W1 (30 ms, nothing
    snapshotted), a state-changing call that runs longer than 70 ms makes replaying cost more."""
    record(api, toy_task, [], W1, {"ok": True}, exec_ms=30)
    assert lookup(api, toy_task, [W1], W2)["snapshot_after_ms"] == 70.0
    assert record(api, toy_task, [W1], W2, {"ok": True}, exec_ms=71)["snapshot"] == "wanted"
    w3 = call("write", path="f", content="3")
    assert lookup(api, toy_task, [W1], w3)["snapshot_after_ms"] == 70.0
    assert record(api, toy_task, [W1], w3, {"ok": True}, exec_ms=69)["snapshot"] == "skipped"
    assert lookup(api, toy_task, [W1, w3, W1], W2)["snapshot_after_ms"] is None  # the history is not all in the graph
    unbudgeted = api.put(
        "/api/v1/tasks/toy0", {"env": {"backend": "external", "name": "toy"}, "sandbox_budget": 0}, format="json"
    )
    assert unbudgeted.status_code == 201, unbudgeted.content
    assert lookup(api, "toy0", [], W1)["snapshot_after_ms"] is None  # no snapshots at all


def test_stale_read_is_a_miss_after_a_write(api, toy_task):
    record(api, toy_task, [], W1, {"ok": True})
    record(api, toy_task, [W1], R, {"output": "1"})
    assert lookup(api, toy_task, [W1], R)["result"] == {"output": "1"}
    record(api, toy_task, [W1, R], W2, {"ok": True})
    after = lookup(api, toy_task, [W1, R, W2], R)
    assert after["hit"] is False
    assert after["matched"] == 3
    assert after["replay"] == [W1, W2]


def test_read_only_calls_hit_in_any_order_between_the_same_writes(api, toy_task):
    ra, rb = call("read", path="a"), call("read", path="b")
    record(api, toy_task, [], W1, {"ok": True})
    record(api, toy_task, [W1], ra, {"output": "a"})
    record(api, toy_task, [W1, ra], rb, {"output": "b"})
    assert lookup(api, toy_task, [W1], rb)["hit"] is True
    assert lookup(api, toy_task, [W1, rb], ra)["hit"] is True


def test_a_call_observed_to_change_nothing_is_recorded_read_only(api, toy_task):
    inspect = call("write", path="f", content="")  # a state-changing tool, observed to change nothing
    node = api.post(
        f"/api/v1/tasks/{toy_task}/record",
        {"history": [W1], "call": inspect, "result": {"ok": True}, "exec_ms": 5, "mutated": False},
        format="json",
    ).json()
    assert node["mutates"] is False
    assert lookup(api, toy_task, [W1], inspect) == {
        "hit": True,
        "node_id": node["node_id"],
        "mutates": False,
        "result": {"ok": True},
    }
    record(api, toy_task, [W1], W2, {"ok": True})
    # Later calls match without it in the history; a history that keeps it is keyed as if it
    # changed the state (safe: a miss; a client told `mutates: false` drops it).
    assert lookup(api, toy_task, [W1], W2)["hit"] is True
    assert lookup(api, toy_task, [W1, inspect], W2)["hit"] is False


def test_mutated_must_be_a_boolean(api, toy_task):
    response = api.post(
        f"/api/v1/tasks/{toy_task}/record",
        {"history": [], "call": W1, "result": {}, "exec_ms": 1, "mutated": "no"},
        format="json",
    )
    assert response.status_code == 400
    assert response.json()["error"] == {
        "code": "invalid_payload",
        "message": "'mutated' must be a bool.",
        "details": {"field": "mutated"},
    }


def file_times(api, task, history, c, replay):
    response = api.post(
        f"/api/v1/tasks/{task}/file-times", {"history": history, "call": c, "replay": replay}, format="json"
    )
    assert response.status_code == 200, response.content
    return response.json()["file_times"]


def test_a_replay_gets_the_file_times_its_calls_left_when_recorded(api, toy_task):
    # Client mode: a record carries the times of what the call changed; a client that replays the
    # calls asks for them, to write them back after each (the live run's times, not the replay's).
    record(api, toy_task, [], W1, {"ok": True}, file_times={"f": 1_700_000_000_123_456_789, "d": 0})
    record(api, toy_task, [W1], R, {"output": "1"})
    record(api, toy_task, [W1, R], W2, {"ok": True}, file_times={"f": 2**63 - 1})
    left_w1, left_w2 = {"f": 1_700_000_000_123_456_789, "d": 0}, {"f": 2**63 - 1}
    assert file_times(api, toy_task, [W1, R, W2], R, [W1, W2]) == [left_w1, left_w2]
    assert file_times(api, toy_task, [W1, R, W2], R, [W2]) == [left_w2]  # after a fork at W1's snapshot
    assert file_times(api, toy_task, [W1, R, W2], R, []) == []
    # Not the history's last state-changing calls: nothing known to write back.
    assert file_times(api, toy_task, [W1, R, W2], R, [W1]) == [None]
    assert file_times(api, toy_task, [W1, R, W2], R, [W2, W1]) == [None, None]
    # A call recorded without times (an environment that cannot tell) has none; one that changed
    # no entry's time has {}.
    record(api, toy_task, [W1, R, W2], W1, {"ok": True})
    record(api, toy_task, [W1, R, W2, W1], W2, {"ok": True}, file_times={})
    assert file_times(api, toy_task, [W1, R, W2, W1, W2], R, [W2, W1, W2]) == [left_w2, None, {}]
    # The first record of a path keeps its times: a later record of the same path changes nothing.
    record(api, toy_task, [], W1, {"ok": True}, file_times={"f": 5})
    assert file_times(api, toy_task, [W1], R, [W1]) == [left_w1]


def test_record_is_idempotent(api, toy_task):
    first = record(api, toy_task, [], W1, {"ok": True})
    second = record(api, toy_task, [], W1, {"ok": "ignored"})
    assert second == {**first, "created": False}
    assert lookup(api, toy_task, [], W1)["result"] == {"ok": True}


def test_a_record_tells_the_client_which_of_its_snapshots_were_evicted_lately(api, toy_task):
    """Over the task's budget of snapshots the least worth is evicted; the records that follow tell
    the client its ref (to delete what it holds) for EVICTION_NOTICE_S, then no more."""
    from cache.models import Snapshot

    history, refs = [], []
    for i in range(5):  # one over the toy task's budget of 4
        made = call("write", path="f", content=str(i))
        node = record(api, toy_task, history, made, {"ok": i}, exec_ms=5000)["node_id"]
        history.append(made)
        refs.append(f"snap-{i}")
        registered = api.post(
            f"/api/v1/tasks/{toy_task}/nodes/{node}/snapshots", {"ref": refs[-1], "backend": "external"}, format="json"
        )
        assert registered.status_code == 201, registered.content
    evicted = registered.json()["evicted"]
    assert len(evicted) == 1 and evicted[0] in refs
    assert record(api, toy_task, history, R, {"output": "x"})["evicted"] == evicted
    Snapshot.objects.filter(ref=evicted[0]).update(evicted_at=timezone.now() - timedelta(seconds=61))
    assert record(api, toy_task, history, call("read", path="g"), {"output": "y"})["evicted"] == []


def test_miss_resumes_from_the_deepest_snapshot_with_a_lease(api, toy_task):
    record(api, toy_task, [], W1, {"ok": True}, exec_ms=5000)
    n2 = record(api, toy_task, [W1], W2, {"ok": True}, exec_ms=5000)
    assert n2["snapshot"] == "wanted"
    reg = api.post(
        f"/api/v1/tasks/{toy_task}/nodes/{n2['node_id']}/snapshots",
        {"ref": "snap-2", "backend": "external", "size_bytes": 10, "create_ms": 30},
        format="json",
    )
    assert reg.status_code == 201, reg.content
    w3 = call("write", path="f", content="3")
    miss = lookup(api, toy_task, [W1, R, W2, w3], R)
    assert miss["hit"] is False
    assert miss["resume"]["node_id"] == n2["node_id"]
    assert miss["resume"]["snapshot_ref"] == "snap-2"
    assert miss["resume"]["replay"] == [w3]
    assert miss["replay"] == [W1, W2, w3]
    released = api.delete(f"/api/v1/leases/{miss['resume']['lease_id']}?restore_ms=12")
    assert released.status_code == 204


def test_a_caller_that_follows_the_history_is_offered_no_snapshot_and_leases_none(api, toy_task):
    record(api, toy_task, [], W1, {"ok": True}, exec_ms=5000)
    node = record(api, toy_task, [W1], W2, {"ok": True}, exec_ms=5000)["node_id"]
    api.post(f"/api/v1/tasks/{toy_task}/nodes/{node}/snapshots", {"ref": "s", "backend": "external"}, format="json")
    assert lookup(api, toy_task, [W1, W2], R, resume=False) == {
        "hit": False,
        "matched": 2,
        "resume": None,
        "replay": [W1, W2],
        "snapshot_after_ms": 100.0,
    }
    assert Lease.objects.count() == 0
    assert lookup(api, toy_task, [W1, W2], R, resume=True)["resume"]["snapshot_ref"] == "s"
    assert Lease.objects.count() == 1


@pytest.mark.django_db(transaction=True)  # autocommit, as lookups run when served
def test_leases_and_claims_commit_asynchronously_and_only_themselves(api, toy_task):
    record(api, toy_task, [], W1, {"ok": True}, exec_ms=5000)
    node = record(api, toy_task, [W1], W2, {"ok": True}, exec_ms=5000)["node_id"]
    api.post(f"/api/v1/tasks/{toy_task}/nodes/{node}/snapshots", {"ref": "s", "backend": "external"}, format="json")
    assert lookup(api, toy_task, [W1, W2], R, rollout_id="r1", claim=True)["claim"] == "granted"
    assert lookup(api, toy_task, [W1, W2], R)["resume"]["lease_id"]
    with connection.cursor() as cursor:  # the setting lived as long as their own transactions
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "on"


def test_cheap_writes_are_not_snapshotted(api, toy_task):
    assert record(api, toy_task, [], W1, {"ok": True}, exec_ms=1)["snapshot"] == "skipped"
    assert record(api, toy_task, [W1], R, {"ok": True}, exec_ms=99_999)["snapshot"] == "skipped"


def test_non_cacheable_tool_always_misses(api):
    api.put(
        "/api/v1/tasks/clock",
        {"env": {}, "tools": {"now": {"cacheable": False, "mutates_state": False}}},
        format="json",
    )
    record(api, "clock", [], call("now"), {"t": 1})
    assert lookup(api, "clock", [], call("now"))["hit"] is False
    stats = api.get("/api/v1/tasks/clock/stats").json()
    assert (stats["hits"], stats["oracle_hits"]) == (0, 1)


def test_changing_the_environment_means_old_results_never_hit(api, toy_task):
    record(api, toy_task, [], W1, {"ok": True})
    task = api.put(
        f"/api/v1/tasks/{toy_task}",
        {"env": {"backend": "external", "name": "toy-v2"}, "tools": {"read": {"mutates_state": False}}},
        format="json",
    ).json()
    assert lookup(api, toy_task, [], W1)["hit"] is False
    stale = api.post(
        f"/api/v1/tasks/{toy_task}/record",
        {"history": [], "call": W1, "result": {}, "exec_ms": 1, "env_fingerprint": "0" * 64},
        format="json",
    )
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "env_changed"
    assert task["env_fingerprint"] != "0" * 64


def test_a_record_right_after_the_environment_changed_is_filed_under_the_new_one(api, toy_task):
    """The record's keys come from this process's handle of the task, outdated here (no lookup
    since the change): its statement sees the task's new version and is run again with new keys."""
    first = record(api, toy_task, [], W1, {"ok": 1})
    api.put(
        f"/api/v1/tasks/{toy_task}",
        {"env": {"backend": "external", "name": "toy-v2"}, "tools": {"read": {"mutates_state": False}}},
        format="json",
    )
    second = record(api, toy_task, [], W1, {"ok": 2})
    assert second["node_id"] != first["node_id"]
    hit = lookup(api, toy_task, [], W1)
    assert (hit["hit"], hit["result"], hit["node_id"]) == (True, {"ok": 2}, second["node_id"])


def test_stats_per_epoch_and_tool(api, toy_task):
    for epoch in (0, 1):
        lookup(api, toy_task, [], W1, epoch=epoch, rollout_id=f"r{epoch}")
        if epoch == 0:
            record(api, toy_task, [], W1, {"ok": True}, exec_ms=250, epoch=0)
        lookup(api, toy_task, [W1], R, epoch=epoch, rollout_id=f"r{epoch}")
        if epoch == 0:
            record(api, toy_task, [W1], R, {"output": "1"}, exec_ms=50, epoch=0)
    stats = api.get(f"/api/v1/tasks/{toy_task}").json()["stats"]
    assert (stats["calls"], stats["hits"], stats["executed_ms"], stats["saved_ms"]) == (4, 2, 300, 300)
    assert [e["hit_rate"] for e in stats["per_epoch"]] == [0.0, 1.0]
    assert {t["tool"]: t["hits"] for t in stats["per_tool"]} == {"read": 1, "write": 1}
    assert stats["oracle_hit_rate"] == stats["hit_rate"] == 0.5
    assert stats["rollouts"] == 2


def test_graph_export_has_parent_edges(api, toy_task):
    n1 = record(api, toy_task, [], W1, {"ok": True})
    n2 = record(api, toy_task, [W1], R, {"output": "1"})
    graph = api.get(f"/api/v1/tasks/{toy_task}/graph").json()
    assert {(e["source"], e["target"]) for e in graph["edges"]} == {(n1["node_id"], n2["node_id"])}
    sub = api.get(f"/api/v1/tasks/{toy_task}/graph?root={n1['node_id']}&depth=0").json()
    assert [n["id"] for n in sub["nodes"]] == [n1["node_id"]]


def test_graph_export_pages_walk_the_whole_graph_once(api, toy_task):
    """A page is at most `limit` nodes in (depth, id) order; its `next` leads to the rest, every
    node once, and the last page says there is no more."""
    writes = [call("write", path="f", content=str(i)) for i in range(4)]
    ids = [record(api, toy_task, writes[:i], writes[i], {"ok": i})["node_id"] for i in range(4)]
    ids += [
        record(api, toy_task, [writes[0]], call("write", path="g", content=str(i)), {})["node_id"] for i in range(3)
    ]
    whole = api.get(f"/api/v1/tasks/{toy_task}/graph").json()
    assert whole["next"] is None and len(whole["nodes"]) == 7
    seen, after, pages = [], None, 0
    while True:
        query = f"?limit=2&after={after}" if after else "?limit=2"
        page = api.get(f"/api/v1/tasks/{toy_task}/graph{query}").json()
        assert len(page["nodes"]) <= 2
        seen += [node["id"] for node in page["nodes"]]
        pages += 1
        after = page["next"]
        if after is None:
            break
    assert pages == 4 and seen == [node["id"] for node in whole["nodes"]] and sorted(seen) == sorted(ids)
    assert [(n["depth"], n["id"]) for n in whole["nodes"]] == sorted((n["depth"], n["id"]) for n in whole["nodes"])


@pytest.mark.parametrize("after", ["x", "1", "1.x", "-1.2", "1.99999999999999999999", ".3"])
def test_a_graph_page_after_no_cursor_is_refused(api, toy_task, after):
    answer = api.get(f"/api/v1/tasks/{toy_task}/graph?after={after}")
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_payload"


@pytest.mark.parametrize("depth", [1, 50, 500])
def test_lookup_and_record_issue_a_constant_number_of_queries(api, toy_task, django_assert_num_queries, depth):
    history = [call("write", path="f", content=str(i)) for i in range(depth)]
    record(api, toy_task, [], call("warm", up=1), {})  # token verified and backend costs cached
    with django_assert_num_queries(1):  # one statement: the node, else the longest-prefix match (task handle cached)
        assert lookup(api, toy_task, history, R)["hit"] is False
    # The insert checks the task's stamp and reads the nearest snapshot's cost and the evicted
    # snapshots to tell the client in its own statement (task handle cached).
    with django_assert_num_queries(1):
        record(api, toy_task, history, R, {"output": "x"})
    with django_assert_num_queries(1):
        record(api, toy_task, history, call("write", path="g", content="x"), {"ok": True})
    with django_assert_num_queries(1):  # hit with counters
        assert lookup(api, toy_task, history, R, rollout_id="r")["hit"] is True


@pytest.mark.django_db(transaction=True)  # VACUUM cannot run in a transaction
def test_tables_are_vacuumed_when_autovacuum_is_off(toy_task):
    with connection.cursor() as cursor:
        cursor.execute("SHOW autovacuum")
        autovacuum = cursor.fetchone()[0]
    vacuumed = tables_vacuum()
    # Every table of every model, counters included (a list of the busy ones once missed the graph's
    # totals, which bloated): none is left for a later table to be forgotten from.
    tables = {m._meta.db_table for m in apps.get_models() if m._meta.managed and not m._meta.proxy}
    assert set(vacuumed) == (tables if autovacuum == "off" else set())
    assert {"cache_node", "cache_tasktotal", "cache_snapshottotal", "cache_rollouttotal"} <= tables


def test_claimed_miss_makes_other_rollouts_wait_for_its_record(api, toy_task):
    # Client-mode single flight: r1 executes W1, r2 missing on it meanwhile is told to wait.
    assert lookup(api, toy_task, [], W1, rollout_id="r1", claim=True)["claim"] == "granted"
    waiting = lookup(api, toy_task, [], W1, rollout_id="r2", claim=True)
    assert (waiting["hit"], waiting["claim"], waiting["resume"]) == (False, "in_flight", None)
    assert lookup(api, toy_task, [], W1, rollout_id="r1", claim=True)["claim"] == "granted"  # its own retry
    assert "claim" not in lookup(api, toy_task, [], W1)  # a lookup that claims nothing is a plain miss
    node = record(api, toy_task, [], W1, {"ok": True}, rollout_id="r1")
    assert lookup(api, toy_task, [], W1, rollout_id="r2", claim=True) == {
        "hit": True,
        "node_id": node["node_id"],
        "mutates": True,
        "result": {"ok": True},
    }
    # Counted: r1's miss, the plain lookup and r2's hit, not the answers telling r2 to wait.
    stats = api.get(f"/api/v1/tasks/{toy_task}/stats").json()
    assert (stats["calls"], stats["hits"]) == (4, 1)


def test_a_claim_never_recorded_lapses_and_the_next_rollout_executes(api, toy_task, settings):
    settings.TVCACHE = {**settings.TVCACHE, "CLAIM_TTL_S": 0.0}
    assert lookup(api, toy_task, [W1], R, rollout_id="r1", claim=True)["claim"] == "granted"
    assert lookup(api, toy_task, [W1], R, rollout_id="r2", claim=True)["claim"] == "granted"
    assert claims_clear() == 1


def test_claim_needs_a_rollout(api, toy_task):
    response = api.post(f"/api/v1/tasks/{toy_task}/lookup", {"history": [], "call": W1, "claim": True}, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "missing_field"
    assert response.json()["error"]["details"] == {"field": "rollout_id"}


def test_a_rollout_whose_execution_failed_gives_its_claim_up(api, toy_task):
    def release(rollout_id):
        response = api.post(
            f"/api/v1/tasks/{toy_task}/claims/release",
            {"history": [], "call": W1, "rollout_id": rollout_id},
            format="json",
        )
        assert response.status_code == 200, response.content
        return response.json()["released"]

    assert lookup(api, toy_task, [], W1, rollout_id="r1", claim=True)["claim"] == "granted"
    assert release("r2") is False  # not its claim
    assert lookup(api, toy_task, [], W1, rollout_id="r2", claim=True)["claim"] == "in_flight"
    assert release("r1") is True
    assert lookup(api, toy_task, [], W1, rollout_id="r2", claim=True)["claim"] == "granted"
    missing = api.post(f"/api/v1/tasks/{toy_task}/claims/release", {"history": [], "call": W1}, format="json")
    assert (missing.status_code, missing.json()["error"]["code"]) == (400, "missing_field")


def test_the_task_list_comes_a_page_at_a_time_and_filters_by_id(api, toy_task):
    for i in range(4):
        api.put(f"/api/v1/tasks/prompt-{i}", {"env": {"backend": "external"}}, format="json")
    lookup(api, "toy", [], call("write", path="f", content="1"))

    first = api.get("/api/v1/tasks?limit=2").json()
    assert [t["id"] for t in first["tasks"]] == ["prompt-0", "prompt-1"]
    assert (first["count"], first["next_offset"]) == (5, 2)
    last = api.get("/api/v1/tasks?limit=2&offset=4").json()
    assert [t["id"] for t in last["tasks"]] == ["toy"] and last["next_offset"] is None
    assert last["tasks"][0]["stats"]["calls"] == 1  # with its totals
    found = api.get("/api/v1/tasks?q=PROMPT-3").json()
    assert [t["id"] for t in found["tasks"]] == ["prompt-3"] and found["count"] == 1
    assert api.get("/api/v1/tasks").json()["count"] == 5
    for bad in ("limit=0", "limit=1001", "limit=x", "offset=-1"):
        response = api.get(f"/api/v1/tasks?{bad}")
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_payload", bad


def test_a_hit_answers_the_result_in_the_key_order_the_tool_gave(api, toy_task):
    """A policy that renders a dict result as text sees its keys in order: a hit must give the
    bytes the tool gave, not sorted keys."""
    result = {"z": 1, "a": {"y": 2, "b": [{"d": 1, "c": 2}]}, "m": None}
    record(api, toy_task, [], W1, result)
    for _ in range(2):  # from the database, then from the process's hit cache
        response = api.post(f"/api/v1/tasks/{toy_task}/lookup", {"history": [], "call": W1}, format="json")
        assert b'"result":{"z":1,"a":{"y":2,"b":[{"d":1,"c":2}]},"m":null}' in response.content
        assert list(response.json()["result"]) == ["z", "a", "m"]


def test_a_result_stored_with_sorted_keys_before_is_served_and_audited_by_value(api, toy_task):
    from cache.models import Node

    node = record(api, toy_task, [], W1, {"a": 1, "z": 2})["node_id"]
    Node.objects.filter(pk=node).update(result_json='{"a":1,"z":2}')  # as older releases stored it
    assert lookup(api, toy_task, [], W1)["result"] == {"a": 1, "z": 2}
    audited = api.post(f"/api/v1/tasks/{toy_task}/nodes/{node}/audit", {"result": {"z": 2, "a": 1}}, format="json")
    assert audited.status_code == 200 and audited.json()["divergent"] is False
    other = api.post(f"/api/v1/tasks/{toy_task}/nodes/{node}/audit", {"result": {"z": 3, "a": 1}}, format="json")
    assert other.json()["divergent"] is True


def test_a_replay_takes_its_time_off_what_the_hits_saved(api, toy_task):
    """A call a sandbox ran again only to rebuild its state was not saved after all."""
    record(api, toy_task, [], W1, {"ok": True}, exec_ms=250, epoch=0)
    assert lookup(api, toy_task, [], W1, epoch=0, rollout_id="r1")["hit"] is True
    again = record(api, toy_task, [], W1, {"ok": True}, exec_ms=200, epoch=0, rollout_id="r1", replay=True)
    assert again["created"] is False
    record(api, toy_task, [], W1, {"ok": True}, exec_ms=150, epoch=0, rollout_id="r2")  # a racing record: no replay
    stats = api.get(f"/api/v1/tasks/{toy_task}").json()["stats"]
    assert (stats["hits"], stats["saved_ms"], stats["executed_ms"]) == (1, 50, 250)
    bad = api.post(
        f"/api/v1/tasks/{toy_task}/record",
        {"history": [], "call": W1, "result": {}, "exec_ms": 1, "replay": "yes"},
        format="json",
    )
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_payload"
