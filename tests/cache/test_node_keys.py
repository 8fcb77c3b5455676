"""A node's three keys are stored as their 32 bytes, read and written as 64 hex characters: the
migration that converts an existing table keeps every key and every hit."""

from __future__ import annotations

import sys

import pytest
from django.db import connection
from django.db.migrations.loader import MigrationLoader

from cache.models import Node
from tests.support.api import call, lookup, record

pytestmark = pytest.mark.django_db(transaction=True)

CALLS = [call("write", path=f"f{i}", content=str(i)) for i in range(4)]
READ = call("read", path="f0")


def migration_sql(name: str) -> str:
    modules = [sys.modules[type(m).__module__] for m in MigrationLoader(connection).disk_migrations.values()]
    (sql,) = [getattr(module, name) for module in modules if hasattr(module, name)]
    return sql


def hits(api) -> list[int]:
    ids = [lookup(api, "toy", CALLS[:i], c)["node_id"] for i, c in enumerate(CALLS)]
    return [*ids, lookup(api, "toy", CALLS, READ)["node_id"]]


@pytest.fixture
def no_hit_cache(monkeypatch, settings):
    """Every hit read from the table (hitcache.py would answer repeated ones from memory)."""
    from cache.services.hitcache import hit_cache_reset

    monkeypatch.setitem(settings.TVCACHE, "HIT_CACHE_ENTRIES", 0)
    hit_cache_reset()
    yield
    hit_cache_reset()


def test_keys_survive_the_conversion_to_bytes_and_back(api, toy_task, no_hit_cache):
    for i, c in enumerate(CALLS):
        record(api, "toy", CALLS[:i], c, {"ok": i})
    record(api, "toy", CALLS, READ, {"output": "0"})
    keys = list(Node.objects.order_by("pk").values_list("pk", "anchor_key", "call_digest", "state_key"))
    assert all(len(k) == 64 and int(k, 16) >= 0 for row in keys for k in row[1:])
    with connection.cursor() as cursor:
        cursor.execute("SELECT octet_length(anchor_key), octet_length(state_key) FROM cache_node")
        assert set(cursor.fetchall()) == {(32, 32)}
    before = hits(api)
    assert None not in before

    with connection.cursor() as cursor:
        cursor.execute(migration_sql("KEYS_TO_HEX"))  # the table as it was before the migration
        cursor.execute("SELECT id, anchor_key, call_digest, state_key FROM cache_node ORDER BY id")
        assert cursor.fetchall() == keys
        cursor.execute(migration_sql("KEYS_TO_BYTES"))
    assert list(Node.objects.order_by("pk").values_list("pk", "anchor_key", "call_digest", "state_key")) == keys
    assert hits(api) == before
