"""The pools page at the scale of a training run: hundreds of live snapshot images are summed up
in one row per task, a task's images are listed on its own page 50 at a time, newest first, in
a number of statements that does not grow with the images, and the page stays short in Chromium.
The other lists that grow (rollouts, a node's snapshots, the audit log, members) are paged too."""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from playwright.sync_api import expect, sync_playwright

from accounts.projects import DEFAULT_PROJECT, MAINTAINER, TRAINER
from accounts.services.projects import project_named
from cache.ledger import ledger_flush
from cache.models import AuditEntry, Lease, Node, Rollout, Snapshot
from lab.browser import chromium, collect_static, log_in
from lab.server import service_running
from sandboxes.models import Sandbox
from tests.support.graph import PASSWORD

from .test_projects import logged_in, member

SHOTS = Path(settings.BASE_DIR) / "artifacts" / "screenshots"
MIB = 1 << 20
TASKS = 5
IMAGES = 60  # per task: 300 in all
BUDGET = 100
SNAPSHOT_ROW = re.compile(r'<tr data-snapshot="\d+">')
TASK_ROW = re.compile(r'<tr data-task="([^"]+)">')
T0 = timezone.now() - dt.timedelta(days=1)


def key(text: str) -> str:
    """A node key as cache.tcg makes them (a SHA-256 digest in hex)."""
    return hashlib.sha256(text.encode()).hexdigest()


def ref(task: str, k: int) -> str:
    return f"tvcache-snap:{task}-{k:03d}"


def images(task: str, first: int, count: int) -> None:
    """Live images first..first+count-1 of a task, each of its own node: image k is k + 1 MiB,
    taken k seconds after T0 (the newest has the highest k), docker for even k, directory for odd."""
    nodes = Node.objects.bulk_create(
        Node(
            task_id=task,
            anchor_key=key(f"a{k}"),
            call_digest=key(f"c{k}"),
            state_key=key(f"s{k}"),
            depth=1,
            tool="bash",
            call={"tool": "bash", "args": {"command": f"step {k}"}},
            mutates=True,
            result_json="{}",
            result_bytes=2,
            exec_ms=1.0,
            cum_exec_ms=1.0,
        )
        for k in range(first, first + count)
    )
    snapshots = Snapshot.objects.bulk_create(
        Snapshot(
            task_id=task,
            node=node,
            ref=ref(task, k),
            backend="docker" if k % 2 == 0 else "directory",
            size_bytes=(k + 1) * MIB,
        )
        for k, node in zip(range(first, first + count), nodes, strict=True)
    )
    for k, snapshot in zip(range(first, first + count), snapshots, strict=True):
        snapshot.created_at = T0 + dt.timedelta(seconds=k)  # auto_now_add: set after the insert
    Snapshot.objects.bulk_update(snapshots, ["created_at"])


def seed(api, *, per_task: int = IMAGES) -> list[str]:
    """TASKS tasks scale-0..; task i with `per_task` live images, one evicted image, open leases on
    its i oldest images (two on the oldest), a released and an expired lease (neither counts), and
    sandboxes: warming 1, ready roots 2, ready pre-forks i, leased 1, stopping 1, stopped 3."""
    keys = []
    now = timezone.now()
    for i in range(TASKS):
        key = f"scale-{i}"
        response = api.put(
            f"/api/v1/tasks/{key}", {"env": {"backend": "external"}, "sandbox_budget": BUDGET}, format="json"
        )
        assert response.status_code == 201, response.content
        images(key, 0, per_task)
        live = list(Snapshot.objects.filter(task_id=key).order_by("created_at"))
        Snapshot.objects.create(task_id=key, node=live[0].node, ref=f"{key}-gone", backend="docker", status="evicted")
        hour = now + dt.timedelta(hours=1)
        Lease.objects.bulk_create(
            [Lease(snapshot=s, expires_at=hour) for s in live[:i]]
            + [Lease(snapshot=live[0], expires_at=hour)] * (i > 0)
            + [Lease(snapshot=live[-1], expires_at=hour, released_at=now)]
            + [Lease(snapshot=live[-2], expires_at=now - dt.timedelta(minutes=1))]
        )
        states = [("root", "warming")] + [("root", "ready")] * 2 + [("fork", "ready")] * i
        states += [("fork", "leased"), ("root", "stopping")] + [("root", "stopped")] * 3
        Sandbox.objects.bulk_create(
            Sandbox(
                task_id=key, backend="docker", pool=pool, state=state, snapshot=live[-1] if pool == "fork" else None
            )
            for pool, state in states
        )
        keys.append(key)
    return keys


@pytest.mark.django_db
def test_the_pools_page_sums_up_each_task_in_one_row(staff_client, api):
    keys = seed(api)
    page = staff_client.get("/pools/")
    assert page.status_code == 200
    rows = page.context["pools"]["tasks"]
    assert [row["task_id"] for row in rows] == keys
    for i, row in enumerate(rows):
        assert (row["snapshots"], row["bytes"], row["budget"]) == (IMAGES, IMAGES * (IMAGES + 1) // 2 * MIB, BUDGET)
        assert row["leased"] == i  # open leases only, a snapshot with two counted once
        assert row["preforks"] == i
        assert row["states"] == {"warming": 1, "ready": 2 + i, "leased": 1, "stopping": 1}
        assert row["backends"] == ["directory", "docker"]
    assert page.context["pools"]["totals"] == {
        "tasks": TASKS,
        "snapshots": TASKS * IMAGES,  # the evicted ones left out
        "bytes": TASKS * IMAGES * (IMAGES + 1) // 2 * MIB,
        "sandboxes": sum(5 + i for i in range(TASKS)),  # warming to stopping
    }
    html = page.content.decode()
    assert TASK_ROW.findall(html) == keys and not SNAPSHOT_ROW.search(html)
    assert ref("scale-0", 0) not in html  # the images are on each task's page
    assert f'<td class="n c-snapshots">{IMAGES} <span class="muted">/ {BUDGET}</span></td>' in html
    assert '<a href="/pools/?task=scale-3">scale-3</a>' in html


@pytest.mark.django_db
def test_the_tasks_are_paged_too(staff_client, api, monkeypatch):
    monkeypatch.setattr("dashboard.selectors.POOL_TASKS_PAGE_SIZE", 2)
    seed(api, per_task=2)
    pages = [staff_client.get(f"/pools/?page={n}") for n in (1, 2, 3)]
    assert [TASK_ROW.findall(p.content.decode()) for p in pages] == [
        ["scale-0", "scale-1"],
        ["scale-2", "scale-3"],
        ["scale-4"],
    ]
    html = pages[1].content.decode()
    assert "tasks 3–4 of 5 · page 2 of 3" in html
    assert 'href="?page=1"' in html and 'href="?page=3"' in html
    assert pages[1].context["pools"]["totals"]["snapshots"] == 2 * TASKS  # the totals are of every task


@pytest.mark.django_db
def test_a_tasks_images_are_paged_newest_first(staff_client, api):
    seed(api)
    first = staff_client.get("/pools/?task=scale-2")
    assert [s["ref"] for s in first.context["pools"]["snapshots"]] == [ref("scale-2", k) for k in range(59, 9, -1)]
    html = first.content.decode()
    assert len(SNAPSHOT_ROW.findall(html)) == 50
    assert "newest first: 1–50 of 60" in html and "page 1 of 2" in html
    assert 'href="?task=scale-2&amp;page=2"' in html  # "Older"
    assert "60.0 MiB" in html  # the newest image's size
    second = staff_client.get("/pools/?task=scale-2&page=2")
    assert [s["ref"] for s in second.context["pools"]["snapshots"]] == [ref("scale-2", k) for k in range(9, -1, -1)]
    assert len(SNAPSHOT_ROW.findall(second.content.decode())) == 10
    assert "scale-2-gone" not in first.content.decode() + second.content.decode()  # evicted
    summary = first.context["pools"]["summary"]
    assert (summary["snapshots"], summary["leased"], summary["preforks"]) == (IMAGES, 2, 2)
    assert {(p["pool"], p["states"]["ready"]) for p in summary["pools"]} == {("root", 2), ("fork", 2)}
    # Past the end: the last page; not a number: the first; an unknown task: 404.
    assert staff_client.get("/pools/?task=scale-2&page=9").context["pools"]["snapshots"].number == 2
    assert staff_client.get("/pools/?task=scale-2&page=x").context["pools"]["snapshots"].number == 1
    assert staff_client.get("/pools/?task=nope").status_code == 404
    assert staff_client.get("/pools/?task=scale-2&project=nope").status_code == 404


def statements(client, url: str) -> int:
    with CaptureQueriesContext(connection) as queries:
        assert client.get(url).status_code == 200
    return len(queries)


@pytest.mark.django_db
def test_the_statements_do_not_grow_with_the_images(staff_client, api, django_assert_max_num_queries):
    keys = seed(api, per_task=10)  # 50 images
    urls = ["/pools/", "/pools/?fragment=1", "/pools/?task=scale-1", "/pools/?task=scale-1&page=2&fragment=1"]
    for url in urls:
        staff_client.get(url)  # the engine's health is cached for a few seconds; sessions are warm
    few = {url: statements(staff_client, url) for url in urls}
    for key in keys:
        images(key, 10, IMAGES - 10)  # 300 images
    assert Snapshot.objects.filter(status="live").count() == TASKS * IMAGES
    many = {url: statements(staff_client, url) for url in urls}
    assert many == few
    with django_assert_max_num_queries(16):
        staff_client.get("/pools/")
    with django_assert_max_num_queries(16):
        staff_client.get("/pools/?task=scale-1")


@pytest.mark.django_db
def test_the_live_fragment_is_the_pages_own(staff_client, api):
    seed(api)
    page = staff_client.get("/pools/?task=scale-1&page=2").content.decode()
    assert 'data-fragment="/pools/?task=scale-1&amp;page=2&amp;fragment=1"' in page
    fragment = staff_client.get("/pools/?task=scale-1&page=2&fragment=1").content.decode()
    assert "<html" not in fragment and "<form" not in fragment
    assert len(SNAPSHOT_ROW.findall(fragment)) == 10
    assert 'href="?task=scale-1&amp;page=1"' in fragment  # its links lead to pages, not fragments
    assert "fragment" not in fragment
    summary = staff_client.get("/pools/?fragment=1").content.decode()
    assert TASK_ROW.findall(summary) == [f"scale-{i}" for i in range(TASKS)] and "<html" not in summary
    assert 'data-fragment="/pools/?fragment=1"' in staff_client.get("/pools/").content.decode()


@pytest.mark.django_db
def test_maintainers_keep_their_controls(api, staff_user):
    seed(api)
    maintainer = logged_in(member("max", DEFAULT_PROJECT, MAINTAINER))
    trainer = logged_in(member("tim", DEFAULT_PROJECT, TRAINER))
    outsider = logged_in(member("oz", "elsewhere", TRAINER)).get("/pools/")
    assert outsider.status_code == 200 and outsider.context["pools"]["tasks"] == []
    stop = 'action="/pools/control/stop-sandbox/"'
    assert stop in maintainer.get("/pools/").content.decode()
    assert stop not in trainer.get("/pools/").content.decode()
    html = maintainer.get("/pools/?task=scale-0").content.decode()
    assert stop in html and '<input type="hidden" name="next" value="/pools/?task=scale-0">' in html
    evict = re.findall(r'data-control="evict-snapshot" href="([^"]+)"', html)
    assert len(evict) == 50
    assert 'data-control="evict-snapshot"' not in trainer.get("/pools/?task=scale-0").content.decode()
    newest = Snapshot.objects.get(ref=ref("scale-0", IMAGES - 1))
    url = evict[0].replace("&amp;", "&")
    assert url == f"/tasks/scale-0/nodes/{newest.node_id}/evict-snapshot/?next=/pools/%3Ftask%3Dscale-0"
    assert maintainer.get(url).status_code == 200  # the confirmation page
    done = maintainer.post(url, {"confirm": "yes", "next": "/pools/?task=scale-0"})
    assert done.status_code == 302 and done["Location"] == "/pools/?task=scale-0"
    assert Snapshot.objects.get(pk=newest.pk).status == "evicted"
    after = maintainer.get("/pools/?task=scale-0")
    assert after.context["pools"]["summary"]["snapshots"] == IMAGES - 1
    assert after.context["pools"]["snapshots"][0]["ref"] == ref("scale-0", IMAGES - 2)


def rows(html: str, table: str) -> int:
    """Rows of a table's body."""
    body = html[html.index(f'id="{table}"') :]
    body = body[body.index("<tbody>") : body.index("</tbody>")]
    return body.count("<tr")


@pytest.mark.django_db
def test_the_other_lists_that_grow_are_paged(staff_client, api):
    """The task page's rollouts, a node's snapshots, the audit log and a project's members: one
    page each, with a pager that keeps the page's other parameters."""
    seed(api, per_task=2)
    Rollout.objects.bulk_create(Rollout(task_id="scale-0", rollout_id=f"r{k:03d}") for k in range(120))
    task = staff_client.get("/tasks/scale-0/").content.decode()
    assert rows(task, "rollouts-table") == 50 and "latest first: 1–50 of 120" in task
    assert 'href="?page=2#rollouts-table"' in task
    assert rows(staff_client.get("/tasks/scale-0/?page=3").content.decode(), "rollouts-table") == 20

    node = Snapshot.objects.get(ref=ref("scale-0", 0)).node_id
    Snapshot.objects.bulk_create(
        Snapshot(task_id="scale-0", node_id=node, ref=f"old-{k}", backend="docker", status="deleted") for k in range(24)
    )
    page = staff_client.get(f"/tasks/scale-0/nodes/{node}/")
    html = page.content.decode()
    assert rows(html, "node-snapshots") == 20 and "1–20 of 26" in html  # with the live one and the evicted one
    assert page.context["live_snapshot"].ref == ref("scale-0", 0)  # whichever page it is on
    assert rows(staff_client.get(f"/tasks/scale-0/nodes/{node}/?page=2").content.decode(), "node-snapshots") == 6

    alpha = project_named("alpha", create=True)
    AuditEntry.objects.bulk_create(
        AuditEntry(actor_name="alice", action="node_pin", project=alpha, target=f"t{k}", outcome="ok")
        for k in range(60)
    )
    audit = staff_client.get("/audit/?project=alpha").content.decode()
    assert rows(audit, "audit-table") == 50 and 'href="?project=alpha&amp;page=2"' in audit
    assert rows(staff_client.get("/audit/?project=alpha&page=2").content.decode(), "audit-table") == 10

    for k in range(55):
        member(f"user{k:02d}", "alpha", TRAINER)
    project = staff_client.get("/projects/alpha/?tokens_page=1").content.decode()
    assert rows(project, "members-table") == 50 and "members 1–50 of 55" in project
    assert 'href="?tokens_page=1&amp;members_page=2#members-table"' in project
    assert rows(staff_client.get("/projects/alpha/?members_page=2").content.decode(), "members-table") == 5


@pytest.fixture
def server(transactional_db, tmp_path):
    """The service as deployed, on the test database and this environment's Redis."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    collect_static()
    with service_running(db=connection.settings_dict, workers=1, log_dir=tmp_path, ready_path="/login/") as service:
        yield service.url


@pytest.mark.slow
@pytest.mark.browser
def test_the_pools_page_stays_short_in_chromium(server, api, token, staff_user):
    seed(api)
    spare = Node.objects.create(
        task_id="scale-2",
        anchor_key=key("spare"),
        call_digest=key("spare"),
        state_key=key("spare"),
        depth=1,
        tool="bash",
        call={"tool": "bash", "args": {"command": "spare"}},
        mutates=True,
        result_json="{}",
        result_bytes=2,
        exec_ms=1.0,
        cum_exec_ms=1.0,
    ).pk
    ledger_flush()
    rest = httpx.Client(base_url=server, headers={"Authorization": f"Token {token}"}, timeout=10)
    # No ORM below: Playwright's sync API runs an event loop in this thread.
    with sync_playwright() as playwright:
        browser = chromium(playwright)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        log_in(page, server, "alice", PASSWORD)

        page.goto(server + "/pools/")
        expect(page.locator("#pools-table tbody tr[data-task]")).to_have_count(TASKS)
        expect(page.locator("#pools-snapshots")).to_contain_text(str(TASKS * IMAGES))
        expect(page.locator("#live-status")).to_have_class("live on")
        height = page.evaluate("document.body.scrollHeight")
        assert height < 2000, height
        page.screenshot(path=str(SHOTS / "pools-summary.png"), full_page=True)

        # A task's images, a page at a time; one taken now appears at the top, live.
        page.click("#pools-table >> text=scale-2")
        expect(page).to_have_url(server + "/pools/?task=scale-2")
        rows = page.locator("#snapshots-table tbody tr[data-snapshot]")
        expect(rows).to_have_count(50)
        expect(rows.first).to_contain_text(ref("scale-2", IMAGES - 1))
        expect(page.locator("#live-status")).to_have_class("live on")
        response = rest.post(
            f"/api/v1/tasks/scale-2/nodes/{spare}/snapshots",
            json={"ref": "tvcache-snap:taken-now", "backend": "docker", "size_bytes": 3 * MIB},
        )
        assert response.status_code == 201, response.text
        expect(rows.first).to_contain_text("tvcache-snap:taken-now", timeout=5000)
        expect(page.locator("#pool-snapshots")).to_contain_text(str(IMAGES + 1))
        expect(rows).to_have_count(50)
        page.screenshot(path=str(SHOTS / "pools-task.png"), full_page=True)
        page.click("#snapshots-pager >> text=Older")
        expect(page).to_have_url(server + "/pools/?task=scale-2&page=2")
        expect(rows).to_have_count(IMAGES + 1 - 50)
        browser.close()
    assert errors == []
