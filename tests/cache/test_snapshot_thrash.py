"""A task at its snapshot budget is not asked for a snapshot that its eviction would throw away
as soon as it is registered (the newest state of a long path, worth the least to the eviction's
scoring until other rollouts use it): each such snapshot was a commit of the sandbox for nothing,
on every call once the budget filled."""

from __future__ import annotations

import pytest

from cache.models import Snapshot
from cache.services import node_record, snapshot_register, task_put
from cache.tcg import ToolCall
from cache.tcg.records import CallContext, CallRecord

pytestmark = pytest.mark.django_db(transaction=True)


def test_no_snapshot_is_wanted_that_its_own_registration_would_evict():
    task_put(task_id="thrash", env={"backend": "external", "thrash": 1}, sandbox_budget=3)
    history: list[ToolCall] = []
    wanted = 0
    for step in range(60):
        made = ToolCall("bash", {"command": f"step {step}"})
        outcome = node_record(
            task_id="thrash",
            record=CallRecord(CallContext(tuple(history), made, "r", 0, None), {"stdout": str(step)}, 2000.0, True),
            evicted=False,
        )
        history.append(made)
        if outcome.snapshot_wanted:  # as a client that takes what it is asked for
            wanted += 1
            _, evicted = snapshot_register(
                task_id="thrash", node_id=outcome.node_id, ref=f"s{step}", backend="external", create_ms=100.0
            )
            assert f"s{step}" not in evicted, f"step {step}: asked for a snapshot that was evicted at once"
    assert wanted >= 3  # it was asked for snapshots until the budget filled
    assert Snapshot.objects.filter(task_id="thrash", status="live").count() == 3
