"""Moving to projects keeps what exists working: tasks and tokens made before become the
default project's, tasks keep their ids as keys, and tokens become maintainers (every token could
do everything before)."""

from __future__ import annotations

import pytest
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from rest_framework.test import APIClient

from accounts.services.tokens import key_digest

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("cache", "0007_node_divergent_state"), ("dashboard", "0002_tool_uncacheable"), ("upstreams", "0001_initial")]


def test_existing_tasks_and_tokens_move_to_the_default_project_as_maintainers():
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes()
    executor.migrate(BEFORE)
    old = executor.loader.project_state(BEFORE).apps
    old.get_model("cache", "Task").objects.create(
        id="legacy", env={"backend": "external"}, env_fingerprint="f" * 64, tools={}, sandbox_budget=3
    )
    old.get_model("cache", "ApiToken").objects.create(name="old-trainer", key_digest=key_digest("tvc_old-key"))
    executor = MigrationExecutor(connection)
    executor.migrate(latest)

    from accounts.models import ApiToken, Project
    from cache.models import Task

    task = Task.objects.get(pk="legacy")
    assert (task.project.name, task.name) == ("default", "legacy")
    token = ApiToken.objects.get(name="old-trainer")
    assert (token.project.name, token.role) == ("default", "maintainer")
    assert Project.objects.get(name="default").network is True  # the service's network rule alone, as before
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token tvc_old-key")
    assert client.get("/api/v1/tasks/legacy").json()["id"] == "legacy"
    assert (
        client.put("/api/v1/tasks/legacy", {"env": {"backend": "external", "v": 2}}, format="json").status_code == 200
    )


def test_the_audit_log_moves_to_the_cache_app_with_its_rows():
    before = [
        ("cache", "0010_projects_required"),
        ("dashboard", "0003_auditentry_project"),
        ("upstreams", "0001_initial"),
    ]
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes()
    executor.migrate(before)
    old = executor.loader.project_state(before).apps
    project = old.get_model("cache", "Project").objects.create(name="alpha")
    old.get_model("dashboard", "AuditEntry").objects.create(
        actor_name="ann",
        action="node_pin",
        task_id="alpha.t1",
        project_id=project.pk,
        target="task t1 / node 3",
        outcome="ok",
        details={"pinned": True},
    )
    ContentType.objects.filter(app_label="cache", model="auditentry").delete()  # as before the move
    content_type = ContentType.objects.get_or_create(app_label="dashboard", model="auditentry")[0]
    ContentType.objects.clear_cache()
    executor = MigrationExecutor(connection)
    executor.migrate(latest)

    from cache.models import AuditEntry

    entry = AuditEntry.objects.get()
    assert (entry.actor_name, entry.action, entry.project.name, entry.details) == (
        "ann",
        "node_pin",
        "alpha",
        {"pinned": True},
    )
    AuditEntry.objects.create(
        actor_name="bea", action="task_flush", task_id="alpha.t1", target="task t1", outcome="ok"
    )  # the table's id sequence moved with it
    assert AuditEntry.objects.count() == 2
    assert "dashboard_auditentry" not in connection.introspection.table_names()
    assert ContentType.objects.get_for_model(AuditEntry).pk == content_type.pk  # its permissions stay with it
