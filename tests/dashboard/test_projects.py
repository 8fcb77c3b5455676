"""The dashboard and its websocket per project: staff see every project; members see
theirs, with a project switcher; another project's pages, graph JSON and controls are 404; a
trainer member sees but controls nothing (403), a maintainer member controls its project's tasks
(audited under their name); the project page shows usage against grants and the tokens; the
websocket sends a user only the events of their projects."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.test import Client

from accounts.models import Membership, Project
from accounts.projects import DEFAULT_PROJECT
from accounts.services.projects import project_named
from cache import ledger
from cache.models import AuditEntry, Node
from sandboxes.models import Sandbox
from tests.support.api import project_clients
from tests.support.graph import build_tree
from tvcache_site.asgi import application

from .test_live import lookup, receive_json, session_headers

ALPHA_TASK, BETA_TASK = "alpha.only-alpha", "beta.task-0"
EXTERNAL = {"env": {"backend": "external"}, "tools": {"read": {"mutates_state": False}}, "sandbox_budget": 4}


def member(username: str, project: str, role: str):
    user = get_user_model().objects.create_user(username)
    Membership.objects.create(project=project_named(project, create=True), user=user, role=role)
    return user


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def world(db, staff_user):
    # The default project, which migration makes and first use remakes (a transactional test
    # before this one flushed it).
    project_named(DEFAULT_PROJECT)
    clients = project_clients()
    alpha, beta = clients["alpha", "maintainer"], clients["beta", "maintainer"]
    alpha.put("/api/v1/tasks/only-alpha", EXTERNAL, format="json")
    tree = build_tree(alpha, "only-alpha")
    beta.put("/api/v1/tasks/task-0", EXTERNAL, format="json")
    users = {
        "ann": member("ann", "alpha", "trainer"),
        "max": member("max", "alpha", "maintainer"),
        "bea": member("bea", "beta", "maintainer"),
        "staff": staff_user,
    }
    return {"tree": tree, "users": users, "clients": {name: logged_in(user) for name, user in users.items()}}


def pages(task: str, node: int) -> list[str]:
    return [
        f"/tasks/{task}/",
        f"/tasks/{task}/graph/",
        f"/tasks/{task}/nodes/{node}/",
        f"/dashboard-api/tasks/{task}/graph",
        f"/dashboard-api/tasks/{task}/nodes?ids={node}",
        f"/dashboard-api/tasks/{task}/search?q=make",
        f"/dashboard-api/tasks/{task}/reveal/{node}",
    ]


def controls(task: str, node: int) -> list[str]:
    return [
        f"/tasks/{task}/nodes/{node}/evict-subtree/",
        f"/tasks/{task}/nodes/{node}/evict-snapshot/",
        f"/tasks/{task}/nodes/{node}/pin/",
        f"/tasks/{task}/nodes/{node}/unpin/",
        f"/tasks/{task}/control/flush/",
        f"/tasks/{task}/control/budget/",
    ]


@pytest.mark.django_db
def test_pages_and_controls_follow_projects_and_roles(world):
    node = world["tree"]["test"]
    expected = {"ann": (200, 403), "max": (200, 200), "staff": (200, 200), "bea": (404, 404)}
    for name, (page_status, control_status) in expected.items():
        client = world["clients"][name]
        for url in pages(ALPHA_TASK, node):
            response = client.get(url)
            assert response.status_code == page_status, (name, url)
            if page_status == 404 and url.startswith("/dashboard-api/"):
                assert response.json()["error"]["code"] == "unknown_task"
        for url in controls(ALPHA_TASK, node):
            assert client.get(url).status_code == control_status, (name, url)
            if control_status != 200:
                assert client.post(url, {"confirm": "yes", "sandbox_budget": 0}).status_code == control_status
    assert Node.objects.filter(task_id=ALPHA_TASK).count() == 7 and not AuditEntry.objects.exists()
    # Control buttons show where the user may use them.
    assert "Flush task" in world["clients"]["max"].get(f"/tasks/{ALPHA_TASK}/").content.decode()
    assert "Flush task" not in world["clients"]["ann"].get(f"/tasks/{ALPHA_TASK}/").content.decode()
    # A maintainer member's action is done and audited under their name, in their project's log.
    response = world["clients"]["max"].post(f"/tasks/{ALPHA_TASK}/nodes/{node}/pin/", {"confirm": "yes"})
    assert response.status_code == 302 and Node.objects.get(pk=node).pinned
    entry = AuditEntry.objects.get()
    assert (entry.actor_name, entry.project.name, entry.outcome) == ("max", "alpha", "ok")
    assert world["clients"]["ann"].get("/audit/").context["page"].object_list[0] == entry
    assert list(world["clients"]["bea"].get("/audit/").context["page"].object_list) == []


@pytest.mark.django_db
def test_the_overview_lists_the_users_projects_with_a_switcher(world):
    staff, ann, bea = (world["clients"][name] for name in ("staff", "ann", "bea"))
    everything = staff.get("/")
    assert {t["id"] for t in everything.context["tasks"]} >= {ALPHA_TASK, BETA_TASK}
    assert [p.name for p in everything.context["projects"]] == ["alpha", "beta", "default"]
    html = everything.content.decode()
    assert 'href="/?project=alpha"' in html and 'href="/?project=beta"' in html
    assert [t["id"] for t in staff.get("/?project=beta").context["tasks"]] == [BETA_TASK]
    mine = ann.get("/")
    assert [t["id"] for t in mine.context["tasks"]] == [ALPHA_TASK]
    assert [t["name"] for t in mine.context["tasks"]] == ["only-alpha"]
    assert [p.name for p in mine.context["projects"]] == ["alpha"]
    assert ann.get("/?project=beta").status_code == 404
    assert [t["id"] for t in bea.get("/").context["tasks"]] == [BETA_TASK]
    assert bea.get("/?q=only").context["tasks"] == []
    outsider = logged_in(get_user_model().objects.create_user("nobody"))
    assert outsider.get("/").context["tasks"] == [] and b"not a member of any project" in outsider.get("/").content


@pytest.mark.django_db
def test_pools_show_the_users_projects_and_sandboxes_of_others_cannot_be_stopped(world):
    alpha_row = Sandbox.objects.create(task_id=ALPHA_TASK, backend="directory", pool="root", state="ready")
    beta_row = Sandbox.objects.create(task_id=BETA_TASK, backend="directory", pool="root", state="ready")
    pools = world["clients"]["ann"].get("/pools/").context["pools"]
    assert {t["task_id"] for t in pools["tasks"]} == {ALPHA_TASK}
    assert {t["project"] for t in pools["tasks"]} == {"alpha"}
    assert world["clients"]["ann"].get(f"/pools/?task={BETA_TASK}").status_code == 404
    assert {t["task_id"] for t in world["clients"]["staff"].get("/pools/").context["pools"]["tasks"]} == {
        ALPHA_TASK,
        BETA_TASK,
    }
    stop = "/pools/control/stop-sandbox/"
    assert world["clients"]["ann"].get(stop).status_code == 403  # a trainer member controls nothing
    maintainer = world["clients"]["max"]
    assert maintainer.post(stop, {"confirm": "yes", "sandbox_id": str(beta_row.pk)}).status_code == 404
    assert Sandbox.objects.get(pk=beta_row.pk).state == "ready"
    assert maintainer.post(stop, {"confirm": "yes", "sandbox_id": str(alpha_row.pk)}).status_code == 302
    assert Sandbox.objects.get(pk=alpha_row.pk).state == "stopped"
    assert AuditEntry.objects.get(action="sandbox_stop").project.name == "alpha"


@pytest.mark.django_db
def test_the_project_page_shows_usage_against_grants_and_tokens(world):
    Project.objects.filter(name="alpha").update(max_live_sandboxes=4, max_snapshot_bytes=200_000_000, rate_limit=50)
    Sandbox.objects.create(task_id=ALPHA_TASK, backend="directory", pool="root", state="ready")
    page = world["clients"]["ann"].get("/projects/alpha/")
    assert page.status_code == 200
    usage = {row["what"]: row for row in page.context["usage"]}
    assert (usage["Live sandboxes"]["used"], usage["Live sandboxes"]["granted"]) == (1, 4)
    assert (usage["Snapshot bytes"]["used"], usage["Snapshot bytes"]["granted"]) == (100_000_000, 200_000_000)
    rate = usage["Requests per second (last minute)"]
    assert rate["granted"] == 50 and rate["used"] >= 0
    tokens = {t["name"]: t for t in page.context["tokens"]}
    assert set(tokens) == {"alpha-trainer", "alpha-maintainer"}
    assert tokens["alpha-maintainer"]["role"] == "maintainer" and tokens["alpha-maintainer"]["last_used_at"] is not None
    html = page.content.decode()
    assert "alpha-trainer" in html and "beta-trainer" not in html and "tvc_" not in html
    assert world["clients"]["bea"].get("/projects/alpha/").status_code == 404
    assert world["clients"]["staff"].get("/projects/beta/").status_code == 200


async def receive_all(socket) -> list[dict]:
    """The first message (within 3 s), then every one that follows within half a second of the last."""
    messages = [await receive_json(socket)]
    while not await socket.receive_nothing(timeout=0.5):
        messages.append(await receive_json(socket))
    return messages


@pytest.mark.django_db(transaction=True)
def test_the_websocket_sends_a_user_only_the_events_of_their_projects(settings, world):
    # A prefix of its own: another tvcache on the same Redis (a replay, a demo) sends its events too.
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [settings.REDIS_URL], "prefix": f"test-{uuid.uuid4().hex}"},
        }
    }
    ledger._ledger.paused_until = 0.0
    headers = {name: session_headers(user) for name, user in world["users"].items()}

    async def scenario():
        sockets = {}
        for name in ("ann", "bea", "staff"):
            for topic in ("overview", "pools"):
                socket = WebsocketCommunicator(application, f"/ws/dashboard/{topic}/", headers=headers[name])
                assert (await socket.connect())[0]
                sockets[name, topic] = socket
        refused = WebsocketCommunicator(application, f"/ws/dashboard/tasks/{BETA_TASK}/", headers=headers["ann"])
        assert (await refused.connect())[0] is False
        own = WebsocketCommunicator(application, f"/ws/dashboard/tasks/{ALPHA_TASK}/", headers=headers["ann"])
        assert (await own.connect())[0]
        for task in (ALPHA_TASK, BETA_TASK):
            lookup(task, True, tool="bash")
            await asyncio.to_thread(ledger.pool_changed, task_id=task, pool="root", state="ready")
        ledger.flush_now()
        # The ledger's thread may send a batch's events in more than one message: every message a
        # socket gets until it has been quiet for half a second is read.
        received = await asyncio.gather(*(receive_all(socket) for socket in (*sockets.values(), own)))
        seen = {}
        for key, messages in zip(sockets, received):
            seen[key] = set()
            for message in messages:
                seen[key] |= (
                    set(message["tasks"]) if key[1] == "overview" else {e["task_id"] for e in message["events"]}
                )
        assert seen["ann", "overview"] == seen["ann", "pools"] == {ALPHA_TASK}
        assert seen["bea", "overview"] == seen["bea", "pools"] == {BETA_TASK}
        assert seen["staff", "overview"] == seen["staff", "pools"] == {ALPHA_TASK, BETA_TASK}
        assert {message["task_id"] for message in received[-1]} == {ALPHA_TASK}
        for socket in (*sockets.values(), own):
            await socket.disconnect()

    async_to_sync(scenario)()


@pytest.mark.django_db
def test_the_django_admin_creates_tokens_revokes_them_and_edits_grants(staff_client):
    from django.contrib.messages import get_messages

    from accounts.models import ApiToken
    from accounts.services.tokens import principal_for_key

    project = project_named("gamma", create=True)
    response = staff_client.post(
        "/admin/accounts/apitoken/add/",
        {"name": "from-admin", "project": project.pk, "role": "maintainer", "expires_at_0": "", "expires_at_1": ""},
    )
    assert response.status_code == 302, response.content
    shown = [str(m) for m in get_messages(response.wsgi_request)]
    key = next(
        part for text in shown for part in text.replace("<", " ").replace(">", " ").split() if part.startswith("tvc_")
    )
    principal = principal_for_key(key)
    assert (principal.project, principal.role, principal.token) == ("gamma", "maintainer", "from-admin")
    assert key not in ApiToken.objects.get(name="from-admin").key_digest
    token = ApiToken.objects.get(name="from-admin")
    assert (
        staff_client.post("/admin/accounts/apitoken/", {"action": "revoke", "_selected_action": [token.pk]}).status_code
        == 302
    )
    assert ApiToken.objects.get(name="from-admin").revoked_at is not None
    assert staff_client.get("/admin/accounts/apitoken/").status_code == 200
    # Grants: within the service's maxima.
    form = {
        "name": "gamma",
        "network": "on",
        "images": "[]",
        "max_memory_mb": "256",
        "max_cpus": "",
        "max_pids": "",
        "max_live_sandboxes": "2",
        "max_snapshot_bytes": "",
        "rate_limit": "100",
        "rate_burst": "",
        "memberships-TOTAL_FORMS": "0",
        "memberships-INITIAL_FORMS": "0",
        "memberships-MIN_NUM_FORMS": "0",
        "memberships-MAX_NUM_FORMS": "1000",
    }
    assert staff_client.post(f"/admin/accounts/project/{project.pk}/change/", form).status_code == 302
    project.refresh_from_db()
    assert (project.network, project.max_memory_mb, project.max_live_sandboxes, project.rate_limit) == (
        True,
        256,
        2,
        100,
    )
    too_much = staff_client.post(f"/admin/accounts/project/{project.pk}/change/", {**form, "max_memory_mb": "999999"})
    assert too_much.status_code == 200 and "service&#x27;s maximum" in too_much.content.decode()
