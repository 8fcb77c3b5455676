"""The service's PostgreSQL backend (tvcache_site/postgresql): its pool hands out a quiet
connection without a round trip, and replaces one that the server ended."""

from __future__ import annotations

import select
import time

import psycopg
import pytest
from django.db import connection

from tvcache_site.postgresql.base import DatabaseWrapper

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def pooled():
    settings = {**connection.settings_dict, "CONN_MAX_AGE": 0, "CONN_HEALTH_CHECKS": True}
    settings["OPTIONS"] = {**settings.get("OPTIONS", {}), "pool": {"min_size": 1, "max_size": 1, "timeout": 10}}
    wrapper = DatabaseWrapper(settings, alias="pool-check-test")
    yield wrapper
    wrapper.close()
    wrapper.close_pool()


def test_a_quiet_connection_is_handed_out_as_is_and_one_the_server_ended_is_replaced(pooled, monkeypatch):
    checks = []  # the pool's check statements (psycopg's check_connection sends an empty one)
    execute = psycopg.Connection.execute

    def counted(conn, query, *args, **kwargs):
        if query == "":
            checks.append(conn.info.backend_pid)
        return execute(conn, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "execute", counted)
    pool = pooled.pool

    def checked_out() -> int:
        pooled.ensure_connection()
        with pooled.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            pid = cursor.fetchone()[0]
        pooled.close()  # back to the pool
        return pid

    first = checked_out()
    assert checked_out() == first and checks == []  # quiet: no round trip before the request's own
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [first])
    idle = pool._pool[0]  # the server's goodbye reaches its socket
    deadline = time.monotonic() + 10
    while not select.select([idle.fileno()], [], [], 0.05)[0] and time.monotonic() < deadline:
        pass
    assert checked_out() != first and checks == [first]  # checked, failed, replaced: the request never saw it
