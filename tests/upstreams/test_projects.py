"""Upstreams belong to projects: another project's upstream is 404 to both roles, the
same name in two projects names two upstreams whose proxies make tasks in their own project, and
changing an existing upstream takes the maintainer role."""

from __future__ import annotations

import pytest

from cache.models import Task
from tests.support.api import project_clients
from tests.support.upstreams import interact

from .test_registration import VALID, put

pytestmark = pytest.mark.django_db(transaction=True)


def test_upstreams_are_per_project_and_their_tasks_too(live_server, verl_tool):
    clients = project_clients()
    alpha, beta = clients["alpha", "trainer"], clients["beta", "trainer"]
    config = {**VALID, "url": verl_tool.url}
    made = put(alpha, "sql", config)
    assert made.status_code == 201
    for role in ("trainer", "maintainer"):
        other = clients["beta", role]
        missing = other.get("/api/v1/upstreams/sql")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_upstream"
    # A trainer registers a new upstream; changing an existing one is a maintainer's.
    changed = put(alpha, "sql", {**config, "read_only": True})
    assert changed.status_code == 403 and changed.json()["error"]["code"] == "maintainer_required"
    assert put(clients["alpha", "maintainer"], "sql", {**config, "read_only": True}).status_code == 200
    # Beta's "sql" is another upstream with another proxy path.
    theirs = put(beta, "sql", config)
    assert theirs.status_code == 201 and theirs.json()["proxy_path"] != made.json()["proxy_path"]
    for body in (made.json(), theirs.json()):
        interact(live_server.url + body["proxy_path"], "t1", "select 1", {"task_id": "q1"})
    assert {t.project.name for t in Task.objects.all()} == {"alpha", "beta"}
    assert all(t.pk.startswith(f"{t.project.name}.sql--") for t in Task.objects.all())
