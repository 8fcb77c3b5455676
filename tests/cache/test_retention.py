"""Retention (cache/services/retention.py): a task over its bounds of nodes or result bytes loses its
coldest subtrees in the periodic job (run here by a real Celery worker); pinned, leased and live
nodes and their paths stay; an evicted path misses, from the database and from the process's cache
of hits alike, and is recorded again; what was counted stays. Rollouts nothing needs any more are
expired by the same job, and still counted."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db.models import Sum
from django.utils import timezone

from accounts.models import Project
from cache import selectors
from cache.models import Node, Rollout, RolloutCall, RolloutStep, Task
from cache.services import admin_node_pin, rollouts_expire, tasks_enforce_retention
from cache.services.hitcache import hit_cache_reset, version_move_wait_s
from tests.cache.test_tree_export import export
from tests.support.api import call, lookup, record, wait_for
from workers.tasks import snapshots_collect

pytestmark = pytest.mark.django_db(transaction=True)

EXTERNAL = {"env": {"backend": "external", "name": "retention"}, "tools": {"read": {"mutates_state": False}}}
W = [call("write", path="f", content=str(i)) for i in range(8)]
R = call("read", path="f")


def put(api, task: str, **fields) -> dict:
    response = api.put(f"/api/v1/tasks/{task}", {**EXTERNAL, **fields}, format="json")
    assert response.status_code in (200, 201), response.content
    return response.json()


def walk(api, task: str, path: list[dict], rollout: str = "") -> list[int]:
    """A client-mode rollout along `path`: each call looked up and recorded where it missed."""
    ids, extra = [], {"rollout_id": rollout} if rollout else {}
    for i, c in enumerate(path):
        found = lookup(api, task, path[:i], c, **extra)
        if found["hit"]:
            ids.append(found["node_id"])
        else:
            ids.append(
                record(api, task, path[:i], c, {"out": f"{task}:{i}:{c['args']['content']}"}, **extra)["node_id"]
            )
    return ids


def age(node_ids, hours: float = 2.0) -> None:
    """As if the nodes were recorded `hours` ago and never hit since."""
    Node.objects.filter(pk__in=node_ids).update(created_at=timezone.now() - timedelta(hours=hours), last_hit_at=None)


def collect(task: str, nodes: int) -> None:
    """The periodic job that enforces budgets and retention, run by the worker, until the task keeps
    `nodes` nodes; then as long as the job waits before it is done (its task's version moved:
    what a process served from its cache of hits before is no longer served after)."""
    snapshots_collect.delay()
    wait_for(lambda: Node.objects.filter(task_id=task).count() == nodes, what=f"{task} keeping {nodes} nodes")
    time.sleep(version_move_wait_s())


@pytest.fixture
def long_hit_cache(settings):
    """The process's cache of hits with a window long enough that a cached hit would still be
    served after the eviction if nothing but the window stopped it."""
    settings.TVCACHE = {**settings.TVCACHE, "HIT_CACHE_WINDOW_MS": 3000.0, "HIT_CACHE_ENTRIES": 1024}
    hit_cache_reset()
    yield
    hit_cache_reset()


def test_over_budget_the_cold_subtree_goes_and_pinned_leased_and_live_paths_stay(api, celery_worker, long_hit_cache):
    put(api, "ret")
    cold = walk(api, "ret", [W[0], W[1], W[2]])
    pinned = walk(api, "ret", [W[0], W[3], W[4]])
    leased = walk(api, "ret", [W[0], W[5]])
    response = api.post(
        f"/api/v1/tasks/ret/nodes/{leased[-1]}/snapshots", {"ref": "snap-5", "backend": "external"}, format="json"
    )
    assert response.status_code == 201, response.content
    resume = lookup(api, "ret", [W[0], W[5]], W[7], rollout_id="resuming")["resume"]
    assert resume["node_id"] == leased[-1] and resume["lease_id"]
    admin_node_pin(actor=None, task_id="ret", node_id=pinned[-1], pinned=True)
    age(cold + pinned + leased)
    live = walk(api, "ret", [W[0], W[6]])  # recorded just now: a live rollout's path
    # The cold leaf is in this process's cache of hits, served without a statement until evicted.
    for _ in range(2):
        assert lookup(api, "ret", [W[0], W[1]], W[2])["node_id"] == cold[2]

    put(api, "ret", max_nodes=3)
    collect("ret", 5)

    assert set(Node.objects.filter(task_id="ret").values_list("pk", flat=True)) == {
        cold[0],
        *pinned,
        *leased,
        live[-1],
    }  # over budget still (5 > 3): the rest is spared
    assert lookup(api, "ret", [W[0], W[1]], W[2])["hit"] is False  # not from the cache of hits either
    miss = lookup(api, "ret", [W[0]], W[1])
    assert miss["hit"] is False and miss["matched"] == 1
    assert lookup(api, "ret", [W[0], W[3]], W[4])["node_id"] == pinned[-1]
    # Recorded again, the path hits with the new result.
    again = record(api, "ret", [W[0]], W[1], {"out": "again"})["node_id"]
    assert again not in cold
    found = lookup(api, "ret", [W[0]], W[1])
    assert found["hit"] is True and found["node_id"] == again and found["result"] == {"out": "again"}
    assert Node.objects.get(pk=again).parent_id == cold[0]


def test_eviction_keeps_the_stats_and_the_tree_export_of_the_calls_it_removes(api, celery_worker):
    put(api, "hist")
    for rollout in ("a", "b"):
        walk(api, "hist", [W[0], W[1], W[2]], rollout=rollout)
    lookup(api, "hist", [W[0], W[1], W[2]], R, rollout_id="a")  # a miss counted
    before = api.get("/api/v1/tasks/hist/stats").json()
    age(Node.objects.filter(task_id="hist").values_list("pk", flat=True))
    put(api, "hist", max_nodes=1)
    collect("hist", 1)
    after = api.get("/api/v1/tasks/hist/stats").json()
    # What was counted stays; only the graph's size (what it keeps now) went down.
    graph = {"nodes", "results_bytes"}
    assert {k: v for k, v in after.items() if k not in graph} == {k: v for k, v in before.items() if k not in graph}
    assert (after["nodes"], before["nodes"]) == (1, 3)
    rollouts = [line for line in export(api, "hist") if line["kind"] == "rollout"]
    assert len(rollouts) == 2
    for rollout in rollouts:
        # The same steps and node ids; an evicted node's call has no tool, digest or time any more.
        assert [c["tool"] for c in rollout["calls"]] == ["write", None, None]


def test_after_enforcement_the_task_is_within_its_bounds(api):
    put(api, "big")
    for branch in range(6):
        walk(api, "big", [W[0], call("write", path="g", content=str(branch)), W[1], W[2]])
    age(Node.objects.filter(task_id="big").values_list("pk", flat=True))
    total = Node.objects.filter(task_id="big").aggregate(b=Sum("result_bytes"))["b"]
    put(api, "big", max_nodes=12, max_result_bytes=total // 3)
    assert tasks_enforce_retention()["nodes_evicted"] > 0
    kept = Node.objects.filter(task_id="big")
    assert kept.count() <= 12 and kept.aggregate(b=Sum("result_bytes"))["b"] <= total // 3
    # What stays keeps its paths: every node's parent is there.
    parents = set(kept.exclude(parent=None).values_list("parent_id", flat=True))
    assert parents <= set(kept.values_list("pk", flat=True))
    assert tasks_enforce_retention()["nodes_evicted"] == 0


def test_a_task_takes_its_projects_default_unless_it_sets_its_own(api):
    put(api, "inherit")
    walk(api, "inherit", [W[0], W[1], W[2], W[3]])
    age(Node.objects.filter(task_id="inherit").values_list("pk", flat=True))
    assert tasks_enforce_retention()["nodes_evicted"] == 0  # unbounded
    Project.objects.filter(tasks__pk="inherit").update(task_max_nodes=3)
    assert tasks_enforce_retention()["nodes_evicted"] == 1
    assert put(api, "inherit", max_nodes=1)["max_nodes"] == 1  # the task's own bound wins
    assert tasks_enforce_retention()["nodes_evicted"] == 2
    assert put(api, "inherit")["max_nodes"] == 1  # left out: kept
    assert put(api, "inherit", max_nodes=None)["max_nodes"] is None  # null: the project's again
    assert Task.objects.get(pk="inherit").max_nodes is None


@pytest.mark.parametrize("value", [-1, "5", True, 1.5, 2**31, {}])
def test_a_bad_bound_is_refused(api, value):
    put(api, "bad")
    for field in ("max_nodes", "max_result_bytes"):
        if field == "max_result_bytes" and value == 2**31:
            continue  # a valid byte count
        response = api.put("/api/v1/tasks/bad", {**EXTERNAL, field: value}, format="json")
        assert response.status_code == 400, (field, value)
        assert response.json()["error"]["code"] == "invalid_payload"
        assert response.json()["error"]["details"]["field"] == field
    assert Task.objects.get(pk="bad").max_nodes is None


def test_subtrees_a_rollout_resumes_from_or_executes_under_stay(api):
    """A claim (a client-mode rollout executing the call it missed on) keeps the state it runs in."""
    put(api, "claimed", max_nodes=0)
    path = walk(api, "claimed", [W[0], W[1]])
    age(path)
    miss = lookup(api, "claimed", [W[0], W[1]], W[2], rollout_id="executing", claim=True)
    assert miss["hit"] is False
    assert tasks_enforce_retention()["nodes_evicted"] == 0
    assert selectors.node_subtree_ids(task_id="claimed", node_id=path[0]) == path


def aged_rollout(task: str, rollout: str, days: float = 8.0) -> None:
    """As if the rollout had started and made its last call `days` ago."""
    then = timezone.now() - timedelta(days=days)
    Rollout.objects.filter(task_id=task, rollout_id=rollout).update(started_at=then)
    RolloutStep.objects.filter(rollout__task_id=task, rollout__rollout_id=rollout).update(
        at=int(then.timestamp() * 1e9)
    )


def test_a_rollout_nothing_needs_expires_and_its_task_still_counts_it(api, celery_worker):
    put(api, "aged")
    old = walk(api, "aged", [W[0], W[1]], rollout="old")
    walk(api, "aged", [W[0], W[1], W[2]], rollout="recent")
    # Rollouts that keep a history of their own (tool-server, a verl-tool trajectory): unfinished,
    # it may come back for its next call and its sandbox be rebuilt from that history; ended, not.
    task = Task.objects.get(pk="aged")
    for rollout, finished in (("kept", None), ("ended", timezone.now())):
        row = Rollout.objects.create(task=task, rollout_id=rollout, history_length=1, finished_at=finished)
        RolloutCall.objects.create(rollout=row, position=0, call=W[0])
    before = api.get("/api/v1/tasks/aged/stats").json()  # flushes the ledger: steps written
    assert before["rollouts"] == 4
    for rollout in ("old", "kept", "ended"):
        aged_rollout("aged", rollout)

    snapshots_collect.delay()  # the periodic job, in the worker, with the default keep (7 days)
    wait_for(lambda: not Rollout.objects.filter(rollout_id="ended").exists(), what="the ended rollout expired")

    assert set(Rollout.objects.filter(task_id="aged").values_list("rollout_id", flat=True)) == {"recent", "kept"}
    assert not RolloutStep.objects.filter(rollout__rollout_id="old").exists()
    assert RolloutCall.objects.filter(rollout__rollout_id="kept").count() == 1
    assert RolloutCall.objects.count() == 1  # the ended one's went with it
    # What was counted stays: the rollouts, the calls, hits and savings; the graph is untouched.
    assert api.get("/api/v1/tasks/aged/stats").json() == before
    assert {line["rollout_id"] for line in export(api, "aged") if line["kind"] == "rollout"} == {"recent", "kept"}
    assert lookup(api, "aged", [W[0]], W[1])["node_id"] == old[1]


def test_history_kept_forever_when_the_keep_is_zero(api):
    put(api, "forever")
    walk(api, "forever", [W[0]], rollout="old")
    api.get("/api/v1/tasks/forever/stats")
    aged_rollout("forever", "old", days=400)
    assert rollouts_expire(keep_s=0) == {"rollouts_expired": 0}
    assert rollouts_expire(keep_s=86400, batch=1) == {"rollouts_expired": 1}
    assert api.get("/api/v1/tasks/forever/stats").json()["rollouts"] == 1
