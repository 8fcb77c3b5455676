"""The rollout tree page (/tasks/<id>/tree/): an epoch's rollouts nested under the rollouts they
branched from, the sharing ratio of the shown epoch and of every epoch within the page's bounds,
a page of the export at a time, the task page's access rules; and the page in Chromium."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from django.test import Client
from playwright.sync_api import expect, sync_playwright

from accounts.projects import DEFAULT_PROJECT
from accounts.services.projects import project_named
from cache.ledger import ledger_flush
from cache.models import Rollout
from dashboard.trees import Sharing
from lab.browser import chromium, collect_static, log_in
from lab.server import service_running
from tests.support.api import call, lookup, project_clients, record
from tests.support.graph import PASSWORD

from .test_projects import EXTERNAL, logged_in, member

SHOTS = Path(settings.BASE_DIR) / "artifacts" / "screenshots"
ROW = re.compile(r'<tr class="(root|branch)" data-rollout="([^"]*)" data-parent="([^"]*)" data-depth="(\d+)"')

W1, W2, W3, WC = (call("write", path="f", content=c) for c in ("1", "2", "3", "c"))
R = call("read", path="f")


def run(api, rollout: str, calls: list[dict], *, tokens: bool = True, **fields) -> None:
    """A client-mode rollout: each call looked up and recorded where it missed. With `tokens`, the
    i-th call saw [0, 10i + 5) and generated [10i + 5, 10i + 10): 30 tokens for three calls. The
    page lists rollouts in the export's order, the rows' order."""
    history = []
    for seq, c in enumerate(calls):
        trace = {"seq": seq}
        if tokens:
            trace["tokens"] = {"prompt": [0, 10 * seq + 5], "completion": [10 * seq + 5, 10 * seq + 10]}
        if not lookup(api, "toy", history, c, rollout_id=rollout, **trace, **fields)["hit"]:
            record(api, "toy", history, c, {"ok": seq}, rollout_id=rollout, **trace, **fields)
        if c["tool"] != "read":
            history.append(c)
    ledger_flush()  # the ledger makes rollout rows in batches: one rollout per batch keeps their order


def known_tree(api) -> None:
    """Epoch 3: r1 and r2 are roots of 30 tokens; b1 branches from r1 after its first write and
    declares that it shares r1's first 15 tokens; c1 branches from b1 after its first write without
    declaring, so it shares what made that write: b1's first completion, [5, 10), 10 tokens.
    Epoch 4: a rollout without tokens."""
    run(api, "r1", [W1, R, W2], trajectory_ref="traj-r1", epoch=3)
    run(api, "b1", [W1, R, W3], branch_of={"rollout": "r1", "step": 1, "tokens": {"prompt": [0, 15]}}, epoch=3)
    run(api, "c1", [W1, R, WC], branch_of={"rollout": "b1", "step": 1}, epoch=3)
    run(api, "r2", [W1, R, W2], trajectory_ref="traj-r2", epoch=3)
    run(api, "plain", [W1, R], tokens=False, epoch=4)


def tree_rows(html: str) -> list[tuple[str, str, str, int]]:
    return [(kind, rollout, parent, int(depth)) for kind, rollout, parent, depth in ROW.findall(html)]


def text_of(html: str, element_id: str) -> str:
    match = re.search(rf'id="{element_id}"[^>]*>(.*?)<', html, re.S)
    assert match, element_id
    return match.group(1).strip()


@pytest.mark.django_db
def test_the_page_nests_branches_under_their_origins_with_the_sharing_ratio(api, toy_task, user_client):
    known_tree(api)
    page = user_client.get("/tasks/toy/tree/?epoch=3")
    assert page.status_code == 200
    html = page.content.decode()
    assert tree_rows(html) == [
        ("root", "r1", "", 0),
        ("branch", "b1", "r1", 1),
        ("branch", "c1", "b1", 2),
        ("root", "r2", "", 0),
    ]
    rows = {row["rollout_id"]: row for row in page.context["rows"]}
    assert [(rows[r]["calls"], rows[r]["hits"]) for r in ("r1", "b1", "c1", "r2")] == [(3, 0), (3, 2), (3, 2), (3, 3)]
    assert [(rows[r]["shared"], rows[r]["length"]) for r in ("r1", "b1", "c1", "r2")] == [
        (None, 30),
        (15, 30),
        (10, 30),
        (None, 30),
    ]
    assert rows["r1"]["trajectory_ref"] == "traj-r1" and rows["b1"]["trajectory_ref"] is None
    assert re.search(r'data-rollout="b1".*?<span class="mono">r1</span> after 1 state-changing call\s', html, re.S)

    # 120 tokens flat. Trees: r1 30 + b1 30 - 15 + c1 30 - 10 + r2 30 = 95. With the shared
    # prompt, r1 and r2 also share their first call's prompt, 5 tokens: 5 + 25 + 15 + 20 + 25 = 90.
    shown = page.context["shown"]
    assert (shown["rollouts"], shown["branches"]) == (4, 2)
    assert shown["sharing"] == Sharing(flat=120, tree=95, ratio=120 / 95)
    assert shown["sharing_prompt"] == Sharing(flat=120, tree=90, ratio=120 / 90)
    assert text_of(html, "sharing") == "1.26×" and text_of(html, "sharing-prompt") == "1.33×"

    # Per epoch, newest first; epoch 4's calls carried no tokens.
    table = html[html.index('id="epoch-sharing"') :]
    cells = re.findall(r'<tr data-epoch="(\d+)".*?</tr>', table, re.S)
    assert cells == ["4", "3"]
    epoch_rows = re.findall(r"<td class=\"n\">([^<]*)</td>", table)
    assert epoch_rows == ["1", "0", "n/a", "n/a", "4", "2", "1.26×", "1.33×"]

    # Without ?epoch=: the latest epoch, its selector listing both.
    latest = user_client.get("/tasks/toy/tree/")
    assert latest.context["epoch"] == 4 and tree_rows(latest.content.decode()) == [("root", "plain", "", 0)]
    assert text_of(latest.content.decode(), "sharing") == "n/a"
    options = re.findall(r'<option value="(\d+)"( selected)?>', latest.content.decode())
    assert options == [("4", " selected"), ("3", "")]
    # The task page links it.
    assert 'href="/tasks/toy/tree/"' in user_client.get("/tasks/toy/").content.decode()


@pytest.mark.django_db
def test_the_tree_pages_by_the_export_cursor_and_bounds_the_ratio_read(toy_task, user_client, monkeypatch):
    monkeypatch.setattr("dashboard.trees.PAGE_ROLLOUTS", 2)
    for rollout_id, origin in [("r0", ""), ("b0", "r0"), ("r1", ""), ("b1", "r0"), ("c0", "b0"), ("x", "ghost")]:
        Rollout.objects.create(
            task_id="toy", rollout_id=rollout_id, epoch=0, branch_of=origin, branch_step=1 if origin else None
        )
    Rollout.objects.create(task_id="toy", rollout_id="old", epoch=-1)
    Rollout.objects.create(task_id="toy", rollout_id="y", epoch=0, branch_of="old", branch_step=0)

    pages, url = [], "/tasks/toy/tree/?epoch=0"
    while url:
        html = user_client.get(url).content.decode()
        origins = re.findall(r'data-rollout="([^"]*)".*?(?:badge unknown">([^<]*)<|</tr>)', html, re.S)
        pages.append((tree_rows(html), text_of(html, "tree-range"), dict(origins)))
        found = re.search(r'href="([^"]*)" id="next-page"', html)
        url = "/tasks/toy/tree/" + found.group(1).replace("&amp;", "&") if found else None
    assert pages == [
        ([("root", "r0", "", 0), ("branch", "b0", "r0", 1)], "rollouts 1–2 of 7 · page 1", {"r0": "", "b0": ""}),
        (
            [("root", "r1", "", 0), ("root", "b1", "", 0)],
            "rollouts 3–4 of 7 · page 2",
            {"r1": "", "b1": "another page"},
        ),
        (
            [("root", "c0", "", 0), ("root", "x", "", 0)],
            "rollouts 5–6 of 7 · page 3",
            {"c0": "another page", "x": "unknown rollout"},
        ),
        ([("root", "y", "", 0)], "rollouts 7–7 of 7 · page 4", {"y": "epoch -1"}),
    ]

    # Every epoch's ratio while the whole task fits the read bound; over it, the shown epoch's
    # alone if it fits; else none, and the page's rollouts alone.
    page = user_client.get("/tasks/toy/tree/?epoch=0")
    assert [(e["epoch"], e["sharing"]) for e in page.context["epochs"]] == [
        (0, Sharing(0, 0, None)),
        (-1, Sharing(0, 0, None)),
    ]
    monkeypatch.setattr("dashboard.trees.RATIO_ROLLOUTS", 7)
    page = user_client.get("/tasks/toy/tree/?epoch=0")
    assert [(e["epoch"], e["sharing"]) for e in page.context["epochs"]] == [(0, Sharing(0, 0, None)), (-1, None)]
    page = user_client.get("/tasks/toy/tree/?epoch=-1")
    assert [(e["epoch"], e["sharing"]) for e in page.context["epochs"]] == [(0, None), (-1, Sharing(0, 0, None))]
    monkeypatch.setattr("dashboard.trees.RATIO_ROLLOUTS", 6)
    page = user_client.get("/tasks/toy/tree/?epoch=0")
    assert [e["sharing"] for e in page.context["epochs"]] == [None, None]
    html = page.content.decode()
    assert text_of(html, "sharing") == "–" and "Not computed: this epoch (7 rollouts" in html
    assert text_of(html, "page-sharing") == "n/a"


@pytest.mark.django_db
def test_origins_in_a_circle_are_listed_flat_and_said(toy_task, user_client):
    Rollout.objects.create(task_id="toy", rollout_id="a", branch_of="b", branch_step=1)
    Rollout.objects.create(task_id="toy", rollout_id="b", branch_of="a", branch_step=1)
    page = user_client.get("/tasks/toy/tree/")
    html = page.content.decode()
    assert tree_rows(html) == [("root", "a", "", 0), ("root", "b", "", 0)]
    assert "The branch origins do not form a tree (branch origins form a cycle: a, b)" in html
    assert text_of(html, "sharing") == "–" and "Not computed: the branch origins do not form a tree." in html


@pytest.mark.django_db
def test_another_projects_tree_is_a_404_and_a_bad_query_too(staff_client):
    project_named(DEFAULT_PROJECT)
    alpha = project_clients(projects=("alpha",), roles=("maintainer",))["alpha", "maintainer"]
    alpha.put("/api/v1/tasks/only-alpha", EXTERNAL, format="json")
    url = "/tasks/alpha.only-alpha/tree/"
    assert logged_in(member("ann", "alpha", "trainer")).get(url).status_code == 200
    assert logged_in(member("bea", "beta", "maintainer")).get(url).status_code == 404
    assert staff_client.get(url).status_code == 200
    assert staff_client.get("/tasks/alpha.nothing/tree/").status_code == 404
    for query in ("epoch=x", "after=-1", "page=0", f"epoch={2**31}"):
        assert staff_client.get(f"{url}?{query}").status_code == 404, query
    response = Client().get(url)
    assert response.status_code == 302 and response["Location"].startswith("/login/?next=")


@pytest.fixture
def server(transactional_db, tmp_path):
    """The service as deployed, on the test database and this environment's Redis."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    collect_static()
    with service_running(db=connection.settings_dict, workers=1, log_dir=tmp_path, ready_path="/login/") as service:
        yield service.url


@pytest.mark.slow
@pytest.mark.browser
def test_the_tree_page_in_chromium_shows_the_nesting(server, api, toy_task, staff_user):
    known_tree(api)
    ledger_flush()  # this process buffers counters and steps: the server must see them
    # No ORM below: Playwright's sync API runs an event loop in this thread.
    with sync_playwright() as playwright:
        browser = chromium(playwright)
        page = browser.new_page(viewport={"width": 1300, "height": 800})
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        log_in(page, server, "alice", PASSWORD)
        page.goto(server + "/tasks/toy/")
        page.click("#tree-link")
        expect(page.locator("#epoch-select")).to_have_value("4")
        page.select_option("#epoch-select", "3")  # submits the form
        page.wait_for_url(lambda url: url.endswith("/tasks/toy/tree/?epoch=3"))
        expect(page.locator("#sharing")).to_have_text("1.26×")
        expect(page.locator("#sharing-prompt")).to_have_text("1.33×")

        page.screenshot(path=str(SHOTS / "rollout-tree.png"), full_page=True)

        def left(rollout: str) -> float:
            return page.locator(f'tr[data-rollout="{rollout}"] .rid').bounding_box()["x"]

        assert left("r1") == left("r2") < left("b1") < left("c1")  # a branch is indented under its origin
        browser.close()
    assert errors == []
