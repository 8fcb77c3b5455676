"""The dashboard in headless Chromium against uvicorn (HTTP and websockets) on the test database:
log in, open a task, expand the graph, watch live updates, evict a subtree, read the audit log.
Screenshots of every page go to artifacts/screenshots/."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from django.conf import settings
from django.db import connection
from playwright.sync_api import expect, sync_playwright

from cache.ledger import ledger_flush
from lab.browser import chromium, collect_static, log_in
from lab.server import service_running
from tests.support.api import call
from tests.support.graph import CLONE, MAKE, PASSWORD, TEST, build_tree

SHOTS = Path(settings.BASE_DIR) / "artifacts" / "screenshots"
REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="session")
def static_collected():
    collect_static()


@pytest.fixture
def server(transactional_db, static_collected, tmp_path):
    SHOTS.mkdir(parents=True, exist_ok=True)
    with service_running(
        db=connection.settings_dict, redis_url=REDIS_URL, workers=1, log_dir=tmp_path, ready_path="/login/"
    ) as service:
        yield service.url


def shot(page, name: str) -> None:
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def node_point(page, node_id: int) -> tuple[float, float]:
    """Where a graph node is on the screen (once the viewport has stopped moving)."""
    page.wait_for_function("!tvGraph.cy.animated()")
    box = page.locator("#cy").bounding_box()
    pos = page.evaluate(
        "id => { const p = tvGraph.cy.getElementById(String(id)).renderedPosition(); return [p.x, p.y]; }", node_id
    )
    return box["x"] + pos[0], box["y"] + pos[1]


@pytest.mark.slow
@pytest.mark.browser
def test_dashboard_end_to_end(server, api, token, toy_task, staff_user):
    tree = build_tree(api, toy_task)
    ledger_flush()  # this process buffers counters: the server must see them
    rest = httpx.Client(base_url=server, headers={"Authorization": f"Token {token}"}, timeout=10)
    # No ORM below: Playwright's sync API runs an event loop in this thread.
    with sync_playwright() as playwright:
        browser = chromium(playwright)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))

        page.goto(server + "/")
        expect(page).to_have_url(server + "/login/?next=/")
        shot(page, "login")
        log_in(page, server, "alice", PASSWORD)

        # Overview: the task with its figures and sparkline.
        row = page.locator(f'#overview-table tr[data-task="{toy_task}"]')
        expect(row.locator(".c-calls")).to_have_text("6")
        expect(row.locator(".c-rate")).to_have_text("66.7 %")
        expect(row.locator("svg.spark polyline")).to_have_count(1)
        expect(page.locator("#live-status")).to_have_class("live on")
        shot(page, "overview")

        # Pools: one row per task; a task's live snapshot images on its own pools page.
        page.click("text=Pools")
        expect(page.locator(f'#pools-table tr[data-task="{toy_task}"]')).to_contain_text("2 / 4")
        expect(page.locator("#live-status")).to_have_class("live on")
        shot(page, "pools")
        page.click(f'#pools-table tr[data-task="{toy_task}"] a')
        expect(page.locator("#snapshots-table")).to_contain_text("snap-test")
        page.click("header.top >> text=Tasks")

        # Task page; a lookup through the REST API shows up live.
        row.locator("a").first.click()
        expect(page).to_have_url(f"{server}/tasks/{toy_task}/")
        expect(page.locator("#live-status")).to_have_class("live on")
        expect(page.locator("#live-calls")).to_have_text("6")
        assert rest.post(f"/api/v1/tasks/{toy_task}/lookup", json={"history": [CLONE], "call": MAKE}).json()["hit"]
        expect(page.locator("#live-calls")).to_have_text("7", timeout=5000)
        expect(page.locator("#live-hits")).to_have_text("5")
        expect(page.locator("#epoch-chart canvas")).to_have_count(1)
        shot(page, "task")

        # Graph: the top three levels, then expand "pytest" to load its subtree on demand.
        page.click("text=Browse the tool call graph")
        expect(page.locator("#cy")).to_have_attribute("data-painted", "1")
        assert page.evaluate("tvGraph.cy.nodes().length") == 6  # root + clone, make, ls, read, pytest
        page.mouse.click(*node_point(page, tree["test"]))
        expect(page.locator("#node-panel h3")).to_contain_text(f"#{tree['test']}")
        page.click("#btn-expand")
        page.wait_for_function("tvGraph.cy.nodes().length === 8")
        shot(page, "graph")

        # A node recorded now appears live under its (shown) parent.
        new = call("bash", command="pytest -q --lf")
        recorded = rest.post(
            f"/api/v1/tasks/{toy_task}/record",
            json={"history": [CLONE, MAKE, TEST], "call": new, "result": {"stdout": "ok"}, "exec_ms": 2500.0},
        ).json()
        page.wait_for_function(f"tvGraph.cy.getElementById('{recorded['node_id']}').nonempty()", timeout=5000)

        # Search finds a deep call by its text.
        page.fill("#graph-search", "test_fix")
        expect(page.locator("#search-results li")).to_have_count(1)
        page.locator("#search-results li").first.click()
        expect(page.locator("#node-panel h3")).to_contain_text(f"#{tree['retest']}")
        shot(page, "graph-search")

        # Evict the "pytest" subtree from the UI: confirmation page, then gone from the API.
        page.mouse.click(*node_point(page, tree["test"]))
        expect(page.locator("#node-panel h3")).to_contain_text(f"#{tree['test']}")
        page.click("#node-panel a[data-control=evict-subtree]")
        expect(page.locator("#confirm-nodes")).to_have_text("4")  # pytest, patch, retest, the new node
        shot(page, "confirm")
        page.click("#confirm-button")
        expect(page).to_have_url(f"{server}/tasks/{toy_task}/graph/")
        expect(page.locator(".messages li.success")).to_contain_text("Evict subtree: done")
        expect(page.locator("#cy")).to_have_attribute("data-painted", "1")
        graph = rest.get(f"/api/v1/tasks/{toy_task}/graph").json()
        left = {n["id"] for n in graph["nodes"]}
        assert left.isdisjoint({tree["test"], tree["patch"], tree["retest"], recorded["node_id"]})
        assert {tree["clone"], tree["make"], tree["read"], tree["ls"]} <= left

        # Node detail.
        page.goto(f"{server}/tasks/{toy_task}/nodes/{tree['read']}/")
        expect(page.locator("h1")).to_contain_text("read: foo.py")
        expect(page.locator("details summary")).to_contain_text("140 more lines")
        shot(page, "node")

        # The audit log has the eviction, by alice.
        page.click("text=Audit log")
        entry = page.locator('#audit-table tr[data-action="subtree_evict"]')
        expect(entry).to_contain_text("alice")
        expect(entry).to_contain_text("ok")
        expect(entry).to_contain_text("nodes_deleted: 4")
        shot(page, "audit")
        assert not errors, errors
        browser.close()


@pytest.mark.slow
@pytest.mark.browser
def test_the_task_page_counts_state_keyed_hits_per_tool(server, api, staff_user):
    """Two histories that write the same folder by other paths meet; the second one's read is a
    state-keyed hit, shown in its tool's row beside the state oracle."""
    from tests.support.toolserver import run

    api.put("/api/v1/tasks/merging", {"env": {"backend": "directory"}, "match": "state"}, format="json")

    def write(path: str, content: str) -> dict:
        return {"tool": "write_file", "args": {"path": path, "content": content}}

    read = {"tool": "read_file", "args": {"path": "a"}}
    for step in (write("a", "1"), write("b", "2"), read):
        run(api, "merging", "r1", step)
    for step in (write("b", "0"), write("a", "1"), write("b", "2")):
        run(api, "merging", "r2", step)
    assert run(api, "merging", "r2", read)["cached"] is True
    ledger_flush()
    with sync_playwright() as playwright:
        browser = chromium(playwright)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        log_in(page, server, "alice", PASSWORD)
        page.goto(f"{server}/tasks/merging/")
        row = page.locator('#tool-table tr[data-tool="read_file"]')
        expect(row.locator(".c-state-hits")).to_have_text("1")
        expect(row.locator(".c-state-oracle")).to_have_text("50.0 %")
        expect(page.locator('#tool-table tr[data-tool="write_file"] .c-state-hits')).to_have_text("0")
        expect(page.get_by_text("matching by state")).to_be_visible()
        shot(page, "task-state-hits")
        browser.close()
