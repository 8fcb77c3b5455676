"""Lookup counters are batched in process (the ledger) and written in one transaction: a batch
must never be lost, neither to a flush that fails (PostgreSQL busy or restarting) nor to one bad
key."""

import time

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


def test_a_flush_and_a_tool_server_record_take_their_rows_in_one_order():
    """A tool-server miss's record grows its rollout's history and then counts its execution, in one
    statement (record.record_sql); a flush writes the rollout's counters and the tool's stats. Held
    up between the two (another rollout's record of the same call is not committed yet) while a
    flush starts, the two deadlocked when the flush took the stats first: PostgreSQL aborted one of
    them. Now neither is aborted and both write."""
    import threading

    from django.db import connections, transaction
    from django.test.utils import CaptureQueriesContext

    from cache.services import KeptAppend, node_record, rollout_claim, rollout_unclaim, task_put
    from cache.tcg import ToolCall
    from cache.tcg.records import CallContext, CallRecord

    task_put(task_id="order", env={"backend": "external", "order": 1})
    claim = rollout_claim(task_id="order", rollout_id="r1")
    rollout_unclaim(rollout_pk=claim.rollout.pk)
    made = ToolCall("bash", {"command": "made"})
    ledger.ledger_flush()
    outcomes: dict[str, object] = {}
    release = threading.Event()

    def in_thread(name, work):
        def run():
            try:
                outcomes[name] = work()
            except Exception as exc:  # noqa: BLE001 (compared below)
                outcomes[name] = exc
            finally:
                connections.close_all()

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(0.5)  # it holds what it takes before it waits
        return thread

    def uncommitted():  # another rollout's record of the same call, rolled back once released
        with transaction.atomic():
            node_record(task_id="order", record=CallRecord(CallContext((), made, "r2", 0, None), {"ok": 1}, 1.0))
            release.wait(30)
            transaction.set_rollback(True)
        return "rolled back"

    def recorded():
        with CaptureQueriesContext(connection) as statements:
            node_record(
                task_id="order",
                record=CallRecord(CallContext((), made, "r1", 0, None), {"ok": 2}, 1.0),
                append=KeptAppend(claim.rollout.pk, 0, made),
            )
        return sum(not q["sql"] for q in statements.captured_queries)  # prepared: 1, it was not aborted

    def flushed():
        for _ in range(3):
            ledger.lookup_add(
                task_id="order",
                epoch=0,
                tool="bash",
                rollout_id="r1",
                node_id=None,
                hit=False,
                seen=False,
                saved_ms=0.0,
            )
        ledger.ledger_flush()
        return "written"

    threads = [in_thread("other", uncommitted), in_thread("record", recorded), in_thread("flush", flushed)]
    release.set()
    for thread in threads:
        thread.join(30)
    assert outcomes == {"other": "rolled back", "record": 1, "flush": "written"}
    assert Rollout.objects.get(pk=claim.rollout.pk).history_length == 1
