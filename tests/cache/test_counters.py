"""Lookup counters are batched in process (the ledger) and written in one transaction: a batch
must never be lost, neither to a flush that fails (PostgreSQL busy or restarting) nor to one bad
key."""

import psycopg
import pytest
from django.conf import settings
from django.db import OperationalError, connection

from cache import ledger
from cache.models import Node, Rollout, ToolStat
from lab.server import database_url
from tests.support.api import call, lookup, record

pytestmark = pytest.mark.django_db(transaction=True)

W = call("write", path="f", content="1")


def totals() -> tuple[int, int, int, int]:
    stat = ToolStat.objects.get(task_id="toy", tool="write")
    return stat.calls, stat.hits, Node.objects.get(task_id="toy").hit_count, Rollout.objects.get(rollout_id="r1").calls


def test_a_failed_flush_keeps_its_counts_and_the_next_one_writes_them_all(api, toy_task):
    record(api, "toy", [], W, {"ok": True})
    for _ in range(3):
        assert lookup(api, "toy", [], W, rollout_id="r1")["hit"] is True
    # Another session holds the stats table: the flush gives up on its lock and fails.
    with psycopg.connect(database_url(settings.DATABASES["default"]), autocommit=False) as other:
        other.execute("LOCK TABLE cache_toolstat IN ACCESS EXCLUSIVE MODE")
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '200ms'")
        with pytest.raises(OperationalError):
            ledger.ledger_flush()
        other.rollback()
    with connection.cursor() as cursor:
        cursor.execute("RESET lock_timeout")
    assert ToolStat.objects.get(task_id="toy", tool="write").calls == 0  # nothing of the failed batch
    assert lookup(api, "toy", [], W, rollout_id="r1")["hit"] is True  # counted while the batch waits
    ledger.ledger_flush()
    assert totals() == (4, 4, 4, 4)


def test_a_key_no_column_can_hold_never_enters_the_batch(api, toy_task):
    record(api, "toy", [], W, {"ok": True})
    node = Node.objects.get(task_id="toy").pk
    good = dict(task_id="toy", epoch=0, tool="write", rollout_id="r1", node_id=node, hit=True, seen=True, saved_ms=1.0)
    ledger.lookup_add(**good)
    for bad in ({"epoch": 2**40}, {"tool": "wri\x00te"}, {"rollout_id": "r" * 201}, {"rollout_id": "r\x00"}):
        ledger.lookup_add(**{**good, **bad})
    ledger.lookup_add(**good)
    ledger.ledger_flush()
    assert totals() == (2, 2, 2, 2)
