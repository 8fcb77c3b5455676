"""Projects, members, request counts and API tokens move from the cache app to the accounts app with
their rows: the tables are renamed, never created afresh and copied, so every row keeps its id and
every relation (a member's, a token's, a task's, an audit entry's and an upstream's project) holds;
the database's foreign keys follow the renamed table, the ids go on from where they were, and the
content types (the permissions that refer to them) move too. Migrating back renames them back."""

from __future__ import annotations

import datetime as dt

import pytest
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.services import tokens
from accounts.services.tokens import key_digest

pytestmark = pytest.mark.django_db(transaction=True)

# The schema before the move: the cache's last migration with the projects, no accounts app, and
# upstreams as it was (its 0005 repoints an upstream's project to accounts).
BEFORE = [("cache", "0015_processes"), ("upstreams", "0004_upstream_project_required"), ("accounts", None)]
MOVED = ("project", "membership", "projectrequests", "apitoken")


def _tables() -> set[str]:
    return set(connection.introspection.table_names())


def _foreign_keys_to(table: str) -> set[tuple[str, str]]:
    """(table, column) of every foreign key constraint in the database that references `table`."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT c.conrelid::regclass::text, a.attname FROM pg_constraint c
            JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = ANY (c.conkey)
            WHERE c.contype = 'f' AND c.confrelid = %s::regclass
            """,
            [table],
        )
        return set(cursor.fetchall())


def _rows_before(old) -> dict[str, int]:
    """A project with its grants, a member, a minute of requests, a token, a task, an audit entry and
    an upstream, through the models as they were (cache.Project, ...); their ids."""
    user = old.get_model("auth", "User").objects.create(username="ann")
    old.get_model("cache", "Project").objects.create(name="first")  # ids below alpha's
    alpha = old.get_model("cache", "Project").objects.create(
        name="alpha", network=True, images=["tvcache/busybox:latest"], max_memory_mb=256, rate_limit=50
    )
    member = old.get_model("cache", "Membership").objects.create(project=alpha, user=user, role="maintainer")
    minute = timezone.now().replace(second=0, microsecond=0) - dt.timedelta(minutes=1)
    requests = old.get_model("cache", "ProjectRequests").objects.create(
        project=alpha, minute=minute, admitted=7, refused=2
    )
    token = old.get_model("cache", "ApiToken").objects.create(
        name="alpha-ci", key_digest=key_digest("tvc_alpha-key"), project=alpha, role="trainer"
    )
    old.get_model("cache", "Task").objects.create(
        id="alpha.t1",
        project=alpha,
        name="t1",
        env={"backend": "external"},
        env_fingerprint="f" * 64,
        tools={},
        sandbox_budget=3,
    )
    entry = old.get_model("cache", "AuditEntry").objects.create(
        actor=user, actor_name="ann", action="node_pin", task_id="alpha.t1", project=alpha, target="t", outcome="ok"
    )
    upstream = old.get_model("upstreams", "Upstream").objects.create(
        project=alpha, name="up", protocol="verl-tool", url="http://127.0.0.1:1/", secret_nonce="n", secret_digest="d"
    )
    return {
        "user": user.pk,
        "alpha": alpha.pk,
        "member": member.pk,
        "requests": requests.pk,
        "token": token.pk,
        "entry": entry.pk,
        "upstream": upstream.pk,
    }


def test_projects_members_requests_and_tokens_move_to_accounts_with_their_rows():
    from accounts.models import ApiToken, Membership, Project, ProjectRequests

    content_types = ContentType.objects.get_for_models(Project, Membership, ProjectRequests, ApiToken)
    type_ids = {model._meta.model_name: content_type.pk for model, content_type in content_types.items()}
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes()
    try:
        executor.migrate(BEFORE)
        assert {f"cache_{m}" for m in MOVED} <= _tables()
        assert not {f"accounts_{m}" for m in MOVED} & _tables()
        moved_back = ContentType.objects.filter(app_label="cache", model__in=MOVED)
        assert dict(moved_back.values_list("model", "pk")) == type_ids  # migrating back renames them back
        ids = _rows_before(executor.loader.project_state([node for node in BEFORE if node[1]]).apps)

        executor = MigrationExecutor(connection)
        executor.migrate(latest)
    finally:
        MigrationExecutor(connection).migrate(latest)  # the next tests get the latest schema whatever happened
    ContentType.objects.clear_cache()

    from cache.models import AuditEntry, Task
    from upstreams.models import Upstream

    tables = _tables()
    assert {f"accounts_{m}" for m in MOVED} <= tables
    assert not {f"cache_{m}" for m in MOVED} & tables
    # The database's own foreign keys point at the renamed table: none was dropped or made again.
    assert _foreign_keys_to("accounts_project") == {
        ("accounts_membership", "project_id"),
        ("accounts_projectrequests", "project_id"),
        ("accounts_apitoken", "project_id"),
        ("cache_task", "project_id"),
        ("cache_auditentry", "project_id"),
        ("upstreams_upstream", "project_id"),
    }

    alpha = Project.objects.get(pk=ids["alpha"])
    assert (alpha.name, alpha.network, alpha.images, alpha.max_memory_mb, alpha.rate_limit) == (
        "alpha",
        True,
        ["tvcache/busybox:latest"],
        256,
        50,
    )
    member = Membership.objects.get(pk=ids["member"])
    assert (member.project_id, member.user_id, member.role) == (ids["alpha"], ids["user"], "maintainer")
    assert list(alpha.members.values_list("pk", flat=True)) == [ids["user"]]
    requests = ProjectRequests.objects.get(pk=ids["requests"])
    assert (requests.project_id, requests.admitted, requests.refused) == (ids["alpha"], 7, 2)
    token = ApiToken.objects.get(pk=ids["token"])
    assert (token.name, token.project_id, token.role) == ("alpha-ci", ids["alpha"], "trainer")
    assert list(alpha.tasks.values_list("pk", flat=True)) == ["alpha.t1"]
    assert Task.objects.get(pk="alpha.t1").project_id == ids["alpha"]
    assert AuditEntry.objects.get(pk=ids["entry"]).project_id == ids["alpha"]
    assert Upstream.objects.get(pk=ids["upstream"]).project_id == ids["alpha"]

    # The key still authenticates, inside its project: the token's task ids resolve there.
    tokens._verified.clear()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token tvc_alpha-key")
    answer = client.get("/api/v1/tasks/t1")
    assert answer.status_code == 200 and answer.json()["id"] == "t1"
    assert Project.objects.create(name="beta").pk > ids["alpha"]  # the id sequence moved with its table

    # The content types moved (same rows): the permissions that refer to them stay.
    assert {m: ContentType.objects.get(app_label="accounts", model=m).pk for m in MOVED} == type_ids
    assert not ContentType.objects.filter(app_label="cache", model__in=MOVED).exists()
    assert Permission.objects.get(codename="change_project").content_type_id == type_ids["project"]
