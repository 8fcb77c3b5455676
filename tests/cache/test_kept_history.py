"""A history the service keeps (tool-server mode) costs a rollout's next call only what was appended
since its last one: the claim reads the calls appended since (rollouts.CLAIM_SQL), and the state
chain comes from the memo under keys that name the history without hashing it (kept_digests)."""

from __future__ import annotations

import json

import pytest

from cache.models import Rollout
from cache.services import kept_digests, kept_history, rollout_claim, rollout_history_append, rollout_unclaim, task_put
from cache.services import lookup as lookup_module
from cache.services import rollouts as rollouts_module
from cache.services.lookup import task_chain
from cache.services.tasks import task_handle
from cache.tcg import ToolCall, state_chain
from cache.tcg.records import CallContext

pytestmark = pytest.mark.django_db(transaction=True)


def call(name: str) -> ToolCall:
    return ToolCall("bash", {"command": name})


def claimed(task_id: str, rollout_id: str = "r"):
    claim = rollout_claim(task_id=task_id, rollout_id=rollout_id)
    rollout_unclaim(rollout_pk=claim.rollout.pk)
    return claim


def appended(task_id: str, calls: list[ToolCall], rollout_id: str = "r") -> None:
    claim = rollout_claim(task_id=task_id, rollout_id=rollout_id)
    for index, made in enumerate(calls):
        rollout_history_append(rollout_pk=claim.rollout.pk, call=made, length=len(claim.history) + index)
    rollout_unclaim(rollout_pk=claim.rollout.pk)


@pytest.fixture
def parsed(monkeypatch):
    """How many calls the claims parse."""
    counted = {"calls": 0}
    original = ToolCall.from_json.__func__

    def from_json(cls, data):
        counted["calls"] += 1
        return original(cls, data)

    monkeypatch.setattr(rollouts_module.ToolCall, "from_json", classmethod(from_json))
    return counted


def test_a_rollouts_next_claim_reads_only_the_calls_appended_since(parsed):
    task_put(task_id="kept", env={"backend": "external", "kept": 1})
    first = [call(f"c{i}") for i in range(30)]
    appended("kept", first)
    assert claimed("kept").history == tuple(first)
    appended("kept", [call("c30"), call("c31")])
    parsed["calls"] = 0
    assert claimed("kept").history == (*first, call("c30"), call("c31"))
    assert parsed["calls"] == 2


def test_a_rollout_row_made_again_is_read_whole():
    """Another row under the same task and rollout id (the rollout deleted and started again):
    nothing this process read of the old one is taken for its prefix."""
    task_put(task_id="again", env={"backend": "external", "again": 1})
    appended("again", [call("old 1"), call("old 2")])
    assert len(claimed("again").history) == 2
    Rollout.objects.filter(task_id="again", rollout_id="r").delete()
    assert claimed("again").history == ()
    appended("again", [call("new")])
    assert claimed("again").history == (call("new"),)


def test_kept_digests_name_a_history_by_its_row_length_and_last_call():
    history = (call("a"), call("b"))
    this, after = kept_digests(b"row", history, call("c"))
    assert kept_digests(b"row", (*history, call("c")), call("d"))[0] == after  # the next call's history
    assert kept_digests(b"row", history, call("x"))[1] != after  # another call at the same length
    assert kept_digests(b"other row", history, call("c"))[0] != this
    assert kept_digests(b"row", history[:1], call("b"))[1] == this


def kept_context(history: tuple[ToolCall, ...], made: ToolCall) -> CallContext:
    this, after = kept_digests(b"row", history, made)
    return CallContext(history, made, "r", 0, None, history_digest=this, next_digest=after)


def test_a_rollouts_next_call_computes_no_state_chain(monkeypatch):
    """The chain with the call, kept under the history after it, is the next call's history's:
    no call of the history is hashed again."""
    task_put(task_id="chain", env={"backend": "external", "chain": 1})
    task = task_handle(task_id="chain")
    counted = {"chains": 0}

    def counting(*args, **kwargs):
        counted["chains"] += 1
        return state_chain(*args, **kwargs)

    monkeypatch.setattr(lookup_module, "state_chain", counting)
    history = tuple(call(f"h{i}") for i in range(50))
    first = task_chain(task, kept_context(history, call("x")))
    assert counted["chains"] == 1
    longer = (*history, call("x"))
    second = task_chain(task, kept_context(longer, call("y")))
    assert counted["chains"] == 1
    assert second == state_chain(task.fingerprint, (*longer, call("y")), task.policy)
    assert second.steps[:-1] == first.steps


def test_the_migration_moves_each_history_into_rows_of_its_calls():
    """0023's move: a history kept in the rollout's column becomes its calls' rows, in order, and
    its length (run here on a column made again for the test)."""
    import sys

    from django.db import connection
    from django.db.migrations.loader import MigrationLoader

    from cache.models import RolloutCall

    task_put(task_id="moved", env={"backend": "external", "moved": 1})
    claimed("moved", "long")
    claimed("moved", "empty")
    module = sys.modules[type(MigrationLoader(connection).disk_migrations[("cache", "0023_rollout_calls")]).__module__]
    calls = [call(f"m{i}").to_json() for i in range(12)]
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE cache_rollout ADD COLUMN history jsonb NOT NULL DEFAULT '[]'::jsonb")
        try:
            cursor.execute(
                "UPDATE cache_rollout SET history = %s::jsonb WHERE rollout_id = 'long'", [json.dumps(calls)]
            )
            cursor.execute(module._MOVE)
        finally:
            cursor.execute("ALTER TABLE cache_rollout DROP COLUMN history")
    long, empty = (Rollout.objects.get(task_id="moved", rollout_id=r) for r in ("long", "empty"))
    assert (long.history_length, empty.history_length) == (12, 0)
    assert [c.to_json() for c in kept_history(long.pk, 12)] == calls
    assert not RolloutCall.objects.filter(rollout=empty).exists()


@pytest.mark.parametrize("ended", [False, True])
def test_a_record_that_appends_writes_its_node_history_and_callers_write_together_or_not_at_all(ended):
    """A tool-server miss's record is one statement (record.record_sql): the node, the call's row in
    the kept history and the caller's write (`also`: the sandbox's progress) commit together; where
    the history cannot grow (the rollout ended while the call ran) none of them is written."""
    from django.utils import timezone

    from cache.models import Node, Task
    from cache.services import KeptAppend, node_record
    from cache.tcg.records import CallRecord
    from core.errors import Conflict

    task_put(task_id="together", env={"backend": "external", "together": 1})
    appended("together", [call("c0")])
    claim = claimed("together")
    made = call("c1")
    if ended:
        Rollout.objects.filter(pk=claim.rollout.pk).update(finished_at=timezone.now())
    also = (
        "UPDATE cache_task SET sandbox_budget = 7 WHERE id = %(marked)s AND EXISTS (SELECT FROM go)",
        {"marked": "together"},
    )
    record = CallRecord(CallContext(claim.history, made, "r", 0, None), {"stdout": "1"}, 5.0)
    if ended:
        with pytest.raises(Conflict) as refused:
            node_record(task_id="together", record=record, append=KeptAppend(claim.rollout.pk, 1, made), also=also)
        assert refused.value.code == "rollout_finished"
    else:
        node_record(task_id="together", record=record, append=KeptAppend(claim.rollout.pk, 1, made), also=also)
    row = Rollout.objects.get(pk=claim.rollout.pk)
    written = not ended
    assert Node.objects.filter(task_id="together").count() == int(written)
    budget = Task.objects.get(pk="together").sandbox_budget
    assert (row.history_length, budget == 7) == ((2, True) if written else (1, False))
    assert kept_history(claim.rollout.pk, 2) == ((call("c0"), made) if written else (call("c0"),))
