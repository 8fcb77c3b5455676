"""The task and graph pages read the task's totals (counters), not a scan of its nodes: in headless
Chromium, after a subtree eviction, they show the nodes there are per tool and in all, the median
exec time per tool within a bucket of the exact one, and the graph's top level."""

from __future__ import annotations

import os
import re
from statistics import median

import pytest
from django.db import connection
from playwright.sync_api import expect, sync_playwright

from cache.ledger import ledger_flush
from cache.models import Node
from cache.services import admin_subtree_evict
from lab.browser import chromium, collect_static, log_in
from lab.server import service_running
from tests.support.graph import PASSWORD, build_tree

UNITS = {"ms": 1.0, "s": 1000.0}


@pytest.fixture
def server(transactional_db, tmp_path):
    collect_static()
    with service_running(
        db=connection.settings_dict,
        redis_url=os.environ["REDIS_URL"],
        workers=1,
        log_dir=tmp_path,
        ready_path="/login/",
    ) as service:
        yield service.url


def shown_ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+) (ms|s)", text.strip()).groups()
    return float(value) * UNITS[unit]


@pytest.mark.slow
@pytest.mark.browser
def test_task_and_graph_pages_show_the_totals_left_after_an_eviction(server, api, toy_task, staff_user):
    tree = build_tree(api, toy_task)
    admin_subtree_evict(actor=None, task_id=toy_task, node_id=tree["patch"])  # patch and retest go
    nodes = Node.objects.filter(task_id=toy_task)
    per_tool = {tool: sorted(nodes.filter(tool=tool).values_list("exec_ms", flat=True)) for tool in ("bash", "read")}
    everything, top_level = nodes.count(), nodes.filter(parent__isnull=True).count()
    assert everything == 5 and [len(v) for v in per_tool.values()] == [4, 1]
    ledger_flush()
    with sync_playwright() as playwright:  # no ORM below: Playwright's sync API runs an event loop here
        browser = chromium(playwright)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        log_in(page, server, "alice", PASSWORD)

        page.goto(f"{server}/tasks/{toy_task}/")
        expect(page.locator("#live-nodes")).to_have_text(str(everything))
        for tool, times in per_tool.items():
            cells = page.locator(f'#tool-table tr[data-tool="{tool}"] td')
            expect(cells.nth(6)).to_have_text(str(len(times)))
            # A bucket is 12% wide; the page rounds to a tenth of a second.
            assert abs(shown_ms(cells.nth(7).inner_text()) - median(times)) <= 0.13 * (1 + median(times)) + 50

        page.goto(f"{server}/tasks/{toy_task}/graph/")
        expect(page.locator("#cy")).to_have_attribute("data-painted", "1")
        expect(page.locator("#live-nodes")).to_have_text(str(everything))
        page.mouse.click(*_root_point(page))
        expect(page.locator("#node-panel")).to_contain_text(f"{top_level} call(s) start here")
        assert errors == []
        browser.close()


def _root_point(page) -> tuple[float, float]:
    page.wait_for_function("!tvGraph.cy.animated()")
    box = page.locator("#cy").bounding_box()
    pos = page.evaluate(
        "(() => { const p = tvGraph.cy.getElementById('root').renderedPosition(); return [p.x, p.y]; })()"
    )
    return box["x"] + pos[0], box["y"] + pos[1]
