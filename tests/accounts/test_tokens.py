"""API tokens and projects on the operator's side and at the edge: a request past its project's rate
answers 429 with Retry-After on hot and cold routes alike; tokens expire and are revoked (refused at
once in this process once their cache lapses; `test_tokens_served` checks served processes) and say
when they were last used; the token and project commands."""

from __future__ import annotations

import datetime as dt
import io
import time

import pytest
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from accounts.models import ApiToken, Membership, Project
from accounts.services import tokens
from accounts.services.tokens import TOKEN_CACHE_TTL_S, principal_for_key, token_create
from tests.support.api import call, project_clients

pytestmark = pytest.mark.django_db

W = call("write", path="f", content="1")
EXTERNAL = {"env": {"backend": "external", "name": "tokens"}, "sandbox_budget": 4}


@pytest.fixture
def clients():
    return project_clients()


def test_the_rate_limit_answers_429_with_retry_after_on_hot_and_cold_routes(clients, settings):
    Project.objects.filter(name="alpha").update(rate_limit=1, rate_burst=3)
    tokens._verified.clear()
    tokens._buckets.clear()
    client = clients["alpha", "trainer"]
    assert client.put("/api/v1/tasks/t", EXTERNAL, format="json").status_code == 201
    body = {"history": [], "call": W}
    statuses = [client.post("/api/v1/tasks/t/lookup", body, format="json") for _ in range(2)]
    assert [r.status_code for r in statuses] == [200, 200]
    refused = [client.post("/api/v1/tasks/t/lookup", body, format="json"), client.get("/api/v1/tasks/t")]
    for response in refused:
        assert response.status_code == 429, response.content
        assert response["Retry-After"] == "1" and response.json()["error"]["code"] == "rate_limited"
    # Beta is not alpha: its bucket is its own.
    beta = clients["beta", "trainer"]
    assert all(beta.get("/api/v1/tasks").status_code == 200 for _ in range(5))
    time.sleep(1.1)  # one request per second comes back
    assert client.get("/api/v1/tasks/t").status_code == 200


def test_expired_and_revoked_tokens_are_refused_once_their_cache_lapses(clients, monkeypatch):
    key = token_create(name="short", project="alpha", role="trainer", expires_in=dt.timedelta(seconds=1))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    assert client.get("/api/v1/tasks").status_code == 200
    time.sleep(1.1)  # the cached verification ends with the token's expiry, whatever the TTL
    refused = client.get("/api/v1/tasks")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_token"
    assert client.post("/api/v1/tasks/t/lookup", {"history": [], "call": W}, format="json").status_code == 401

    monkeypatch.setattr(tokens, "TOKEN_CACHE_TTL_S", 0.5)
    other = token_create(name="revoked", project="alpha", role="maintainer")
    assert principal_for_key(other) is not None
    assert tokens.token_revoke(name="revoked")
    assert principal_for_key(other) is not None  # still cached in this process ...
    time.sleep(0.6)
    assert principal_for_key(other) is None  # ... for at most the TTL
    assert TOKEN_CACHE_TTL_S <= 5.0


def test_a_token_says_when_it_was_last_used(clients):
    assert ApiToken.objects.get(name="alpha-trainer").last_used_at is None
    tokens._verified.clear()
    clients["alpha", "trainer"].get("/api/v1/tasks")
    assert ApiToken.objects.get(name="alpha-trainer").last_used_at is not None


def test_token_and_project_commands(django_user_model):
    out = io.StringIO()
    call_command("create_token", "ci", "--project", "newproj", "--role", "maintainer", "--expires", "30", stdout=out)
    key = out.getvalue().strip()
    principal = principal_for_key(key)
    assert (principal.project, principal.role) == ("newproj", "maintainer")
    token = ApiToken.objects.get(name="ci")
    assert token.key_digest != key and key not in token.key_digest  # only the digest is stored
    assert dt.timedelta(days=29) < token.expires_at - token.created_at <= dt.timedelta(days=30)
    call_command("create_token", "plain", stdout=io.StringIO())
    assert (
        ApiToken.objects.get(name="plain").role == "trainer"
        and ApiToken.objects.get(name="plain").project.name == "default"
    )
    with pytest.raises(CommandError):
        call_command("create_token", "ci", stdout=io.StringIO())
    replaced = io.StringIO()  # the demo's way: a fresh token of the same name on each run
    call_command("create_token", "ci", "--project", "newproj", "--role", "maintainer", "--replace", stdout=replaced)
    new = ApiToken.objects.get(name="ci")  # one token of that name: the old one is gone
    assert new.key_digest != token.key_digest and principal_for_key(replaced.getvalue().strip()) is not None
    listed = io.StringIO()
    call_command("list_tokens", "--project", "newproj", stdout=listed)
    assert "ci" in listed.getvalue() and "plain" not in listed.getvalue() and key not in listed.getvalue()
    call_command("revoke_token", "ci", stdout=io.StringIO())
    listed = io.StringIO()
    call_command("list_tokens", stdout=listed)
    assert "revoked" in listed.getvalue() and "plain" in listed.getvalue()
    with pytest.raises(CommandError):
        call_command("revoke_token", "ci", stdout=io.StringIO())

    django_user_model.objects.create_user("carol")
    call_command(
        "project_set",
        "newproj",
        "--network",
        "on",
        "--images",
        "tvcache/busybox:latest",
        "--max-memory-mb",
        "256",
        "--max-live-sandboxes",
        "3",
        "--max-snapshot-bytes",
        "2G",
        "--rate-limit",
        "50",
        "--member",
        "carol:maintainer",
        stdout=io.StringIO(),
    )
    project = Project.objects.get(name="newproj")
    assert (project.network, project.images, project.max_memory_mb, project.max_live_sandboxes) == (
        True,
        ["tvcache/busybox:latest"],
        256,
        3,
    )
    assert (project.max_snapshot_bytes, project.rate_limit) == (2 * 2**30, 50)
    assert Membership.objects.get(project=project, user__username="carol").role == "maintainer"
    call_command("project_set", "newproj", "--max-memory-mb", "none", "--remove-member", "carol", stdout=io.StringIO())
    project.refresh_from_db()
    assert project.max_memory_mb is None and project.max_live_sandboxes == 3  # only what was named changed
    assert not Membership.objects.filter(project=project).exists()
    with pytest.raises(CommandError, match="service's maximum"):
        call_command("project_set", "newproj", "--max-memory-mb", "999999", stdout=io.StringIO())
    with pytest.raises(CommandError, match="runs no image"):
        call_command("project_set", "newproj", "--images", "evil/image", stdout=io.StringIO())
