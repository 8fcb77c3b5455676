"""Shared fixtures. Every test runs against the real PostgreSQL (and Redis, Docker, Chromium
where it needs them); a missing service fails the run instead of skipping."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection
from rest_framework.test import APIClient

from accounts.services.tokens import token_create
from cache import ledger


@pytest.fixture(scope="session", autouse=True)
def _postgres_only(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock():
        assert connection.vendor == "postgresql", "tests run against PostgreSQL only"


@pytest.fixture(scope="session", autouse=True)
def _celery_queue_of_this_session():
    """Tasks enqueued by tests go to a queue of their own, never to a running service's workers."""
    from tvcache_site.celery import app

    default = app.conf.task_default_queue
    app.conf.task_default_queue = f"tvcache-test-{uuid.uuid4().hex[:8]}"
    yield
    with app.connection_for_write() as connection:
        connection.default_channel.queue_delete(app.conf.task_default_queue)
    app.conf.task_default_queue = default


@pytest.fixture(autouse=True)
def _snapshot_costs_of_this_test():
    """The snapshot and restore costs the process caches for a few seconds, and the eviction's
    floors, are this test's: a transactional test's flush removes the measured rows, and a cost
    measured by the test before (a gVisor checkpoint's, say) must not decide which states this one
    snapshots."""
    from cache.services.snapshots import _costs, _floors

    _costs.clear()
    _floors.clear()
    yield


@pytest.fixture(autouse=True)
def _background_snapshots_settled():
    """Snapshots that tool-server misses handed off (sandboxes/services/reserved.py) end within
    their test, before its database is flushed."""
    yield
    from sandboxes.services.reserved import settle

    assert settle(), "background snapshots still running"


@pytest.fixture(scope="session", autouse=True)
def _counters_written_on_read():
    """The ledger's thread of the test process writes no counters: they are written when stats are
    read (servers the tests start flush as configured)."""
    from django.conf import settings

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(settings.TVCACHE, "COUNTER_FLUSH_S", 0)
        yield


@pytest.fixture(autouse=True)
def _counters_flushed_on_read():
    """None leak from one test into the next."""
    _ledger_counts_dropped()
    yield
    _ledger_counts_dropped()  # never written later into another database (the process's exit flush)


def _ledger_counts_dropped() -> None:
    ledger._ledger.flush(write=False)
    ledger._ledger.unwritten = ledger.Counts()


@pytest.fixture(autouse=True)
def _task_caches_of_this_test():
    """This process's handles of tasks and its cache of hits start empty: a test's database is
    rolled back under them, which no change of a task's version announces (a task made again by the
    next test under the same id and version, within the cache's lease, would be served the last
    test's hits)."""
    from cache.services import tasks
    from cache.services.hitcache import hit_cache_reset

    tasks._handles.clear()
    hit_cache_reset()
    yield


@pytest.fixture(autouse=True)
def _hits_unaudited_unless_asked(monkeypatch):
    """Hits are sampled for the determinism audit at random (2 % by default), which would add
    `"audit": true` to one hit answer in fifty; tests that exercise the audit set the task's own
    `audit_rate`."""
    from django.conf import settings

    monkeypatch.setitem(settings.TVCACHE, "DEFAULT_AUDIT_RATE", 0.0)


@pytest.fixture(autouse=True)
def _token_verified_once_in_counted_tests(request, monkeypatch):
    """Statement counts are a request's own. A process verifies a token once per
    TOKEN_CACHE_TTL_S (4 s: one statement per token and process every 4 s, not per request), and a
    busy machine can stretch a counting test past that: there, the verification lasts the test."""
    if "django_assert_num_queries" in request.fixturenames:
        from accounts.services import tokens

        monkeypatch.setattr(tokens, "TOKEN_CACHE_TTL_S", 600.0)
        tokens._verified.clear()


@pytest.fixture(autouse=True)
def _hit_cache_off_in_counted_tests(request, monkeypatch):
    """Statement counts are the database path's: a process's cache of hits (hitcache.py) would
    answer a repeated hit with none, or with one when its lease lapsed meanwhile (50 ms). The
    cached path is counted in tests/cache/test_hit_cache.py."""
    if "django_assert_num_queries" in request.fixturenames:
        from django.conf import settings

        from cache.services.hitcache import hit_cache_reset

        monkeypatch.setitem(settings.TVCACHE, "HIT_CACHE_ENTRIES", 0)
        hit_cache_reset()
        yield
        hit_cache_reset()
    else:
        yield


@pytest.fixture
def celery_worker(transactional_db, settings):
    """A real worker thread consuming the test session's queue on the real Redis broker."""
    from tests.support.toolserver import worker_on
    from tvcache_site.celery import app as celery_app

    assert not settings.CELERY_TASK_ALWAYS_EAGER, "set REDIS_URL: the tests need a real broker"
    with worker_on([celery_app.conf.task_default_queue]):
        yield


@pytest.fixture
def token(db) -> str:
    return token_create(name="trainer")


@pytest.fixture
def api(token) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client


@pytest.fixture
def toy_task(api) -> str:
    response = api.put(
        "/api/v1/tasks/toy",
        {
            "env": {"backend": "external", "name": "toy"},
            "tools": {"read": {"mutates_state": False}},
            "sandbox_budget": 4,
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    return "toy"
