"""Admin controls: staff only, CSRF, a confirmation step, the effect seen through the API, the audit log."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from cache.models import AuditEntry, Lease, Node, Snapshot, Task

pytestmark = pytest.mark.django_db


def graph_ids(api, task: str) -> set[int]:
    response = api.get(f"/api/v1/tasks/{task}/graph")
    assert response.status_code == 200
    return {n["id"] for n in response.json()["nodes"]}


def control_urls(task: str, tree: dict[str, int]) -> list[str]:
    node = f"/tasks/{task}/nodes/{tree['test']}"
    return [
        f"{node}/evict-subtree/",
        f"{node}/evict-snapshot/",
        f"{node}/pin/",
        f"{node}/unpin/",
        f"/tasks/{task}/control/flush/",
        f"/tasks/{task}/control/budget/",
        "/pools/control/stop-sandbox/",
    ]


def test_controls_need_staff(user_client, tree, toy_task):
    anonymous = Client()
    for url in control_urls(toy_task, tree):
        assert anonymous.get(url).status_code == 302, url
        assert anonymous.post(url, {"confirm": "yes"}).status_code == 302, url
        assert user_client.get(url).status_code == 403, url
        assert user_client.post(url, {"confirm": "yes"}).status_code == 403, url
    assert Node.objects.filter(task_id=toy_task).count() == 7
    assert not AuditEntry.objects.exists()


def test_confirmation_page_says_what_will_go(staff_client, tree, toy_task):
    page = staff_client.get(f"/tasks/{toy_task}/nodes/{tree['test']}/evict-subtree/")
    assert page.status_code == 200
    assert page.context["subtree"] == {"nodes": 3, "snapshots": 2, "leased": 0}
    html = page.content.decode()
    assert 'name="csrfmiddlewaretoken"' in html and 'name="confirm" value="yes"' in html
    assert staff_client.get(f"/tasks/{toy_task}/nodes/{tree['test']}/explode/").status_code == 404
    assert staff_client.get(f"/tasks/{toy_task}/nodes/999999/evict-subtree/").status_code == 404


def test_controls_are_csrf_protected(staff_user, tree, toy_task):
    client = Client(enforce_csrf_checks=True)
    client.force_login(staff_user)
    response = client.post(f"/tasks/{toy_task}/nodes/{tree['test']}/evict-subtree/", {"confirm": "yes"})
    assert response.status_code == 403
    assert Node.objects.filter(pk=tree["test"]).exists()
    # With the token from the confirmation page, the same post goes through.
    page = client.get(f"/tasks/{toy_task}/nodes/{tree['test']}/evict-subtree/")
    token = page.context["csrf_token"]
    response = client.post(
        f"/tasks/{toy_task}/nodes/{tree['test']}/evict-subtree/", {"confirm": "yes", "csrfmiddlewaretoken": str(token)}
    )
    assert response.status_code == 302
    assert not Node.objects.filter(pk=tree["test"]).exists()


def test_nothing_happens_without_confirmation(staff_client, tree, toy_task):
    response = staff_client.post(f"/tasks/{toy_task}/nodes/{tree['test']}/evict-subtree/", {})
    assert response.status_code == 400
    assert Node.objects.filter(task_id=toy_task).count() == 7
    assert not AuditEntry.objects.exists()


def test_evict_subtree_deletes_it_and_is_audited(staff_client, staff_user, api, tree, toy_task):
    before = graph_ids(api, toy_task)
    response = staff_client.post(
        f"/tasks/{toy_task}/nodes/{tree['test']}/evict-subtree/",
        {"confirm": "yes", "next": f"/tasks/{toy_task}/graph/"},
    )
    assert response.status_code == 302 and response["Location"] == f"/tasks/{toy_task}/graph/"
    gone = {tree["test"], tree["patch"], tree["retest"]}
    assert graph_ids(api, toy_task) == before - gone
    assert not Snapshot.objects.filter(task_id=toy_task, status=Snapshot.Status.LIVE).exists()
    entry = AuditEntry.objects.get()
    assert (entry.actor, entry.actor_name, entry.action, entry.outcome) == (staff_user, "alice", "subtree_evict", "ok")
    assert entry.details["nodes_deleted"] == 3
    assert {s["ref"] for s in entry.details["snapshots_evicted"]} == {"snap-test", "snap-patch"}
    audit = staff_client.get("/audit/")
    assert "Evict subtree" in audit.content.decode() and "alice" in audit.content.decode()
    # The evicted path is a miss again, and recording it anew works.
    from tests.support.api import lookup
    from tests.support.graph import CLONE, MAKE, TEST

    assert lookup(api, toy_task, [CLONE, MAKE], TEST)["hit"] is False


def test_a_leased_snapshot_blocks_subtree_eviction(staff_client, tree, toy_task):
    snapshot = Snapshot.objects.get(ref="snap-patch")
    Lease.objects.create(snapshot=snapshot, rollout_id="r9", expires_at=timezone.now() + timedelta(minutes=5))
    page = staff_client.get(f"/tasks/{toy_task}/nodes/{tree['test']}/evict-subtree/")
    assert page.context["subtree"]["leased"] == 1
    response = staff_client.post(
        f"/tasks/{toy_task}/nodes/{tree['test']}/evict-subtree/", {"confirm": "yes"}, follow=True
    )
    assert "refused" in response.content.decode()
    assert Node.objects.filter(task_id=toy_task).count() == 7
    entry = AuditEntry.objects.get()
    assert entry.outcome == "refused" and entry.details["code"] == "snapshot_leased"


def test_evict_only_the_snapshot_keeps_the_result(staff_client, api, tree, toy_task):
    response = staff_client.post(f"/tasks/{toy_task}/nodes/{tree['test']}/evict-snapshot/", {"confirm": "yes"})
    assert response.status_code == 302
    assert Snapshot.objects.get(ref="snap-test").status == Snapshot.Status.EVICTED
    assert tree["test"] in graph_ids(api, toy_task)
    # Again: nothing left to evict, refused and logged as such.
    staff_client.post(f"/tasks/{toy_task}/nodes/{tree['test']}/evict-snapshot/", {"confirm": "yes"})
    assert list(AuditEntry.objects.order_by("at").values_list("outcome", flat=True)) == ["ok", "refused"]


def test_pin_budget_and_flush(staff_client, api, tree, toy_task):
    assert staff_client.post(f"/tasks/{toy_task}/nodes/{tree['patch']}/pin/", {"confirm": "yes"}).status_code == 302
    assert Node.objects.get(pk=tree["patch"]).pinned
    # Budget 0: every snapshot goes except the pinned one.
    response = staff_client.post(f"/tasks/{toy_task}/control/budget/", {"confirm": "yes", "sandbox_budget": "0"})
    assert response.status_code == 302
    assert Task.objects.get(pk=toy_task).sandbox_budget == 0
    live = set(Snapshot.objects.filter(task_id=toy_task, status=Snapshot.Status.LIVE).values_list("ref", flat=True))
    assert live == {"snap-patch"}
    bad = staff_client.post(f"/tasks/{toy_task}/control/budget/", {"confirm": "yes", "sandbox_budget": "-1"})
    assert bad.status_code == 400
    assert staff_client.post(f"/tasks/{toy_task}/nodes/{tree['patch']}/unpin/", {"confirm": "yes"}).status_code == 302
    assert not Node.objects.get(pk=tree["patch"]).pinned
    assert staff_client.post(f"/tasks/{toy_task}/control/flush/", {"confirm": "yes"}).status_code == 302
    assert graph_ids(api, toy_task) == set()
    actions = list(AuditEntry.objects.order_by("at", "id").values_list("action", "outcome"))
    assert actions == [("node_pin", "ok"), ("budget_set", "ok"), ("node_unpin", "ok"), ("task_flush", "ok")]
    assert AuditEntry.objects.get(action="budget_set").details["old"] == 4


def test_stop_sandbox_stops_a_real_sandbox(staff_client, toy_task):
    from sandboxes.handles import backend_named, labels
    from sandboxes.models import Sandbox

    backend = backend_named("directory")
    sandbox = backend.start({"backend": "directory", "files": {}}, labels=labels(toy_task))
    row = Sandbox.objects.create(
        task_id=toy_task, backend="directory", pool="root", state="ready", ref=sandbox.sandbox_id
    )
    response = staff_client.post("/pools/control/stop-sandbox/", {"confirm": "yes", "sandbox_id": str(row.pk)})
    assert response.status_code == 302
    row.refresh_from_db()
    assert row.state == "stopped" and not sandbox.alive()
    entry = AuditEntry.objects.get()
    assert (entry.action, entry.target, entry.outcome) == ("sandbox_stop", f"sandbox {row.pk}", "ok")


def test_django_admin_actions_confirm_then_use_the_same_services(staff_client, api, tree, toy_task):
    url = "/admin/cache/node/"
    data = {"action": "evict_subtrees", "_selected_action": [str(tree["patch"])]}
    page = staff_client.post(url, data)
    assert page.status_code == 200 and b"Yes, I'm sure" in page.content
    assert Node.objects.filter(pk=tree["patch"]).exists()
    response = staff_client.post(url, {**data, "confirm": "yes"})
    assert response.status_code == 302
    assert graph_ids(api, toy_task).isdisjoint({tree["patch"], tree["retest"]})
    entry = AuditEntry.objects.get()
    assert (entry.action, entry.actor_name, entry.outcome) == ("subtree_evict", "alice", "ok")
    # Budget through the admin: an intermediate form, then the audited service.
    data = {"action": "set_budget", "_selected_action": [toy_task]}
    assert b"sandbox_budget" in staff_client.post("/admin/cache/task/", data).content
    staff_client.post("/admin/cache/task/", {**data, "confirm": "yes", "sandbox_budget": "9"})
    assert Task.objects.get(pk=toy_task).sandbox_budget == 9
    assert staff_client.get("/admin/cache/auditentry/").status_code == 200
