"""Pages and the graph JSON: login required, what each page shows."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from tests.support.graph import PASSWORD

pytestmark = pytest.mark.django_db


def page_urls(task: str, tree: dict[str, int]) -> list[str]:
    return [
        "/",
        f"/tasks/{task}/",
        f"/tasks/{task}/graph/",
        f"/tasks/{task}/nodes/{tree['test']}/",
        "/pools/",
        "/audit/",
    ]


def test_every_page_needs_a_login(tree, toy_task):
    client = Client()
    for url in page_urls(toy_task, tree):
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith("/login/?next="), url


def test_login_page_logs_in_and_out(plain_user):
    client = Client()
    page = client.get("/login/")
    assert page.status_code == 200 and b'name="password"' in page.content
    response = client.post("/login/", {"username": "bob", "password": "wrong"})
    assert response.status_code == 200 and b"Wrong user name or password" in response.content
    response = client.post("/login/", {"username": "bob", "password": PASSWORD, "next": "/pools/"})
    assert response.status_code == 302 and response["Location"] == "/pools/"
    assert client.get("/").status_code == 200
    assert client.post("/logout/").status_code == 302
    assert client.get("/").status_code == 302


def test_overview_lists_every_task_with_its_figures(user_client, tree, toy_task, api):
    api.put("/api/v1/tasks/empty", {"env": {"backend": "external"}}, format="json")
    page = user_client.get("/")
    assert page.status_code == 200
    html = page.content.decode()
    assert f'data-task="{toy_task}"' in html and 'data-task="empty"' in html
    row = page.context["tasks"][[t["id"] for t in page.context["tasks"]].index(toy_task)]
    # 6 lookups: clone and make hit for both rollouts; "make install" misses twice.
    assert row["stats"]["calls"] == 6 and row["stats"]["hits"] == 4
    assert row["nodes"] == 7 and row["live_snapshots"] == 2
    assert row["epochs"] == [[0, 3, 2], [1, 3, 2]]  # [epoch, calls, hits] for the sparkline
    assert "66.7 %" in html  # hit rate


def test_overview_pages_and_filters_many_tasks(user_client, api, monkeypatch):
    monkeypatch.setattr("dashboard.selectors.OVERVIEW_PAGE_SIZE", 4)
    for i in range(9):
        api.put(f"/api/v1/tasks/prompt-{i:02d}", {"env": {"backend": "external"}}, format="json")
    api.put("/api/v1/tasks/other", {"env": {"backend": "external"}}, format="json")

    first = user_client.get("/")
    assert [t["id"] for t in first.context["tasks"]] == ["other", "prompt-00", "prompt-01", "prompt-02"]
    assert "tasks 1–4 of 10 · page 1 of 3" in first.content.decode()
    last = user_client.get("/?page=3")
    assert [t["id"] for t in last.context["tasks"]] == ["prompt-07", "prompt-08"]
    assert user_client.get("/?page=99").context["tasks"] == last.context["tasks"]  # past the end: the last page
    assert user_client.get("/?page=x").context["tasks"] == first.context["tasks"]

    found = user_client.get("/?q=PROMPT-0&page=3")
    assert [t["id"] for t in found.context["tasks"]] == ["prompt-08"]
    html = found.content.decode()
    # The live refresh fetches the same page of the same filter.
    assert 'data-fragment="/?fragment=1&amp;q=PROMPT-0&amp;page=3"' in html
    assert 'href="?page=2&amp;q=PROMPT-0"' in html
    fragment = user_client.get("/?fragment=1&q=PROMPT-0&page=3")
    assert fragment.context["tasks"] == found.context["tasks"] and b"<form" not in fragment.content
    assert "No task id contains" in user_client.get("/?q=nothing-like-it").content.decode()


def test_task_page_shows_tools_epochs_and_rollouts(user_client, tree, toy_task):
    page = user_client.get(f"/tasks/{toy_task}/")
    assert page.status_code == 200
    tools = {t["tool"]: t for t in page.context["tools"]}
    assert tools["bash"]["calls"] == 6 and tools["bash"]["hits"] == 4
    # Of 8, 30, 900 | 3000, 4000, 12000: 1950, from the task's histogram within a bucket (12%).
    assert tools["bash"]["median_exec_ms"] == pytest.approx(1950.0, rel=0.12)
    assert tools["bash"]["nodes"] == 6
    assert tools["read"]["calls"] == 0 and tools["read"]["nodes"] == 1  # recorded, never looked up
    rollouts = {r["rollout_id"]: r for r in page.context["rollouts"]}
    assert rollouts["r1"]["hits"] == 2 and rollouts["r1"]["misses"] == 1
    html = page.content.decode()
    assert 'id="epochs-data"' in html and 'id="live-calls"' in html
    assert user_client.get("/tasks/nope/").status_code == 404


def test_task_page_pages_its_rollouts_without_counting_them(user_client, tree, toy_task):
    """A long run leaves a task hundreds of thousands of rollouts: the page reads their number
    from the task's counter, not a count of its rows, and still pages them latest first."""
    from cache.models import Rollout
    from dashboard.selectors import ROLLOUTS_PAGE_SIZE

    Rollout.objects.bulk_create(Rollout(task_id=toy_task, rollout_id=f"many{i}") for i in range(2 * ROLLOUTS_PAGE_SIZE))
    with CaptureQueriesContext(connection) as queries:
        page = user_client.get(f"/tasks/{toy_task}/?page=3")
    assert page.status_code == 200
    total = Rollout.objects.filter(task_id=toy_task).count()  # with the toy's, which the page's flush wrote
    rollouts = page.context["rollouts"]
    assert rollouts.paginator.count == total and rollouts.number == 3
    assert len(rollouts) == total - 2 * ROLLOUTS_PAGE_SIZE
    counts = [sql for sql in (q["sql"] or "" for q in queries) if "COUNT(" in sql.upper() and '"cache_rollout"' in sql]
    assert not counts


def test_graph_page_embeds_the_top_levels_only(user_client, tree, toy_task):
    page = user_client.get(f"/tasks/{toy_task}/graph/")
    assert page.status_code == 200
    initial = page.context["initial"]
    ids = {n["id"] for n in initial["nodes"]}
    assert {tree["clone"], tree["make"], tree["ls"], tree["test"], tree["read"]} <= ids
    assert tree["patch"] not in ids and tree["retest"] not in ids  # depth 4 and 5: loaded on demand
    test = next(n for n in initial["nodes"] if n["id"] == tree["test"])
    assert test["children"] == 1 and test["snapshot"] is True and test["label"].startswith("bash: pytest")
    assert initial["top_level"] == 1
    assert b'id="graph-initial"' in page.content and b"cytoscape.min.js" in page.content


def test_node_page_shows_call_result_path_and_snapshot(user_client, tree, toy_task):
    page = user_client.get(f"/tasks/{toy_task}/nodes/{tree['read']}/")
    assert page.status_code == 200
    html = page.content.decode()
    assert [step["id"] for step in page.context["path"]] == [tree["clone"], tree["make"], tree["read"]]
    assert "read: foo.py" in html
    output = next(part for part in page.context["result"] if part["name"] == "output")
    assert output["lines"] == 200 and output["rest"]  # a long output is folded
    assert "Show the rest" in html
    page = user_client.get(f"/tasks/{toy_task}/nodes/{tree['test']}/")
    assert "snap-test" in page.content.decode() and page.context["live_snapshot"].ref == "snap-test"
    assert user_client.get(f"/tasks/{toy_task}/nodes/999999/").status_code == 404


def test_pools_page_falls_back_to_live_snapshots(user_client, tree, toy_task):
    page = user_client.get("/pools/")
    assert page.status_code == 200
    assert [(t["task_id"], t["snapshots"]) for t in page.context["pools"]["tasks"]] == [(toy_task, 2)]
    html = user_client.get(f"/pools/?task={toy_task}").content.decode()  # the task's images
    assert "snap-test" in html and "snap-patch" in html
    assert user_client.get("/pools/?fragment=1").content.decode().count("<h2>") == 1  # the live fragment
    assert user_client.get(f"/pools/?task={toy_task}&fragment=1").content.decode().count("<h2>") == 2


def test_graph_api_needs_a_session(client, tree, toy_task):
    response = client.get(f"/dashboard-api/tasks/{toy_task}/graph")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "not_authenticated"


def test_graph_api_expands_searches_and_reveals(user_client, tree, toy_task):
    expanded = user_client.get(f"/dashboard-api/tasks/{toy_task}/graph?root={tree['test']}&depth=3").json()
    assert [n["id"] for n in expanded["nodes"]] == [tree["test"], tree["patch"], tree["retest"]]
    found = user_client.get(f"/dashboard-api/tasks/{toy_task}/search?q=TEST_FIX").json()["nodes"]
    assert [n["id"] for n in found] == [tree["retest"]]
    revealed = user_client.get(f"/dashboard-api/tasks/{toy_task}/reveal/{tree['retest']}").json()
    assert revealed["path"] == [tree["clone"], tree["make"], tree["test"], tree["patch"], tree["retest"]]
    assert {tree["retest"], tree["ls"], tree["read"]} <= {n["id"] for n in revealed["nodes"]}
    nodes = user_client.get(f"/dashboard-api/tasks/{toy_task}/nodes?ids={tree['ls']},{tree['patch']}").json()["nodes"]
    assert {n["id"]: n["parent"] for n in nodes} == {tree["ls"]: tree["clone"], tree["patch"]: tree["test"]}


@pytest.mark.parametrize(
    "url, code",
    [
        ("/dashboard-api/tasks/toy/graph?root=x", 400),
        ("/dashboard-api/tasks/toy/graph?root=99999999", 404),
        ("/dashboard-api/tasks/nope/graph", 404),
        ("/dashboard-api/tasks/toy/nodes?ids=a,b", 400),
    ],
)
def test_graph_api_rejects_bad_input(user_client, tree, url, code):
    response = user_client.get(url)
    assert response.status_code == code
    assert "error" in json.loads(response.content)


def test_pools_page_renders_the_sandboxes_apps_overview(user_client, tree, toy_task):
    from cache.models import Snapshot
    from sandboxes.models import Sandbox

    for state, count in (("warming", 1), ("ready", 3), ("leased", 2), ("stopping", 4), ("stopped", 5)):
        Sandbox.objects.bulk_create(
            [Sandbox(task_id=toy_task, backend="docker", pool="root", state=state) for _ in range(count)]
        )
    snapshot = Snapshot.objects.create(
        task_id=toy_task,
        node_id=tree["retest"],
        ref="tvcache-snap:abc",
        backend="docker",
        owner="service",
        size_bytes=734_003_200,
    )
    Sandbox.objects.create(
        task_id=toy_task, backend="docker", pool="fork", snapshot=snapshot, state="stopped", start_ms=85.0
    )
    html = user_client.get("/pools/").content.decode()
    assert "healthy" in html and "85 ms" in html
    row = html[html.index('id="pools-table"') :]
    assert all(f'<td class="n">{n}</td>' in row for n in (1, 3, 2, 4))  # warming, ready, leased, stopping
    html = user_client.get(f"/pools/?task={toy_task}").content.decode()  # the task's images
    assert "85 ms" in html and "700.0 MiB" in html and "tvcache-snap:abc" in html
    overview = user_client.get("/")
    assert next(t for t in overview.context["tasks"] if t["id"] == toy_task)["sandboxes"] == 6  # not the stopping ones


def test_task_and_node_pages_show_divergences_per_tool_and_per_node(user_client, tree, toy_task, api, settings):
    from cache.services import divergence_record

    settings.TVCACHE = {**settings.TVCACHE, "AUDIT_MAX_DIVERGENT": 0}
    response = api.post(
        f"/api/v1/tasks/{toy_task}/nodes/{tree['ls']}/audit",
        {"result": {"stdout": "other listing\n", "stderr": "", "exit_code": 0, "timed_out": False}, "rollout_id": "r9"},
        format="json",
    )
    assert response.json() == {"divergent": True}
    divergence_record(
        task_id=toy_task, node_id=tree["make"], tool="bash", kind="state", expected={"files": 3}, observed={"files": 4}
    )

    page = user_client.get(f"/tasks/{toy_task}/")
    assert page.context["divergences"]["per_tool"] == [
        {"tool": "bash", "count": 2, "audit": 1, "state": 1, "divergent_nodes": 1, "uncacheable": True}
    ]
    rows = {row["node_id"]: row for row in page.context["divergences"]["per_node"]}
    assert rows[tree["ls"]]["label"] == "bash: ls -la" and rows[tree["ls"]]["divergent"] is True
    assert rows[tree["make"]]["state"] == 1 and rows[tree["make"]]["divergent"] is False
    html = page.content.decode()
    assert 'id="divergence-tools"' in html and "made uncacheable by the audit" in html
    assert f'href="/tasks/{toy_task}/nodes/{tree["ls"]}/"' in html

    node = user_client.get(f"/tasks/{toy_task}/nodes/{tree['ls']}/")
    html = node.content.decode()
    assert "no: divergent" in html and 'id="node-divergences"' in html
    assert "other listing" in html and "r9" in html
    assert "no: divergent" not in user_client.get(f"/tasks/{toy_task}/nodes/{tree['make']}/").content.decode()
    audit_log = user_client.get("/audit/").content.decode()
    assert "Tool made uncacheable (audit)" in audit_log
