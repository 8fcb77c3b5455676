"""The integrations run against a served tvcache (real HTTP, PostgreSQL), as trainers use it."""

import uuid

import pytest
from tvclient import TVCacheClient

from cache.api.auth import token_create


@pytest.fixture
def tvcache(live_server, transactional_db):
    """A client of the served tvcache, and its address for integrations configured by URL."""
    token = token_create(name="integration")
    with TVCacheClient(live_server.url, token) as client:
        client.url, client.token = live_server.url, token
        yield client


@pytest.fixture
def task_id() -> str:
    # The integrations register each task once per process: a test's tasks are its own.
    return f"task-{uuid.uuid4().hex[:12]}"
