"""The integrations run against a served tvcache (real HTTP, PostgreSQL), as trainers use it."""

import uuid

import pytest

from accounts.services.tokens import token_create
from tvclient import TVCacheClient
from tvclient.integrations import _shared


@pytest.fixture
def tvcache(live_server, transactional_db):
    """A client of the served tvcache, and its address for integrations configured by URL."""
    token = token_create(name="integration")
    with TVCacheClient(live_server.url, token) as client:
        client.url, client.token = live_server.url, token
        yield client


@pytest.fixture(autouse=True)
def _shared_clients_closed():
    """The clients integrations share are per process: closed after each test, so that no
    keep-alive connection holds a server thread (and its database session) open."""
    yield
    _shared.close_clients()


@pytest.fixture
def task_id() -> str:
    # The integrations register each task once per process: a test's tasks are its own.
    return f"task-{uuid.uuid4().hex[:12]}"
