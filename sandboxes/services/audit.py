"""Tool-server mode's determinism audit: a worker re-executes a sampled hit in a sandbox of its
own at the hit's parent state (a fresh sandbox of the task, then the state-changing calls of the
rollout's history before the hit) and compares the results (`SandboxBackend.audit_view`); a
difference is recorded by `cache.services.divergence_record`. The sandbox is removed afterwards.

The rollout that hit is never delayed: the audit is queued once the hit's transaction commits,
and a broker that cannot take it costs only that audit (logged).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from django.db import transaction
from django.utils import timezone

from cache.inputs import CallContext
from cache.models import Divergence, Node, Rollout, Task
from cache.services import divergence_record, task_handle
from cache.services.lookup import task_chain
from cache.tcg import ToolCall, canonical_json
from sandboxes.backends.base import SandboxBackend, SandboxError
from sandboxes.models import Sandbox

from .pools import idle_deadline, sandbox_stop, set_state
from .runtime import backend_named, labels

log = logging.getLogger("tvcache.audit")

EQUAL, DIVERGENT, INCONCLUSIVE, SKIPPED = "equal", "divergent", "inconclusive", "skipped"


def hit_audit_enqueue(*, task_id: str, node_id: int, rollout_pk: int, applied: int) -> None:
    """Have a worker audit the hit of node `node_id` by the rollout whose history's first `applied`
    calls led to it, once the current transaction commits. Never raises."""
    from workers.tasks import hit_audit as audit_task

    def send() -> None:
        try:
            audit_task.apply_async((task_id, node_id, rollout_pk, applied), retry=False)
        except Exception as exc:  # the broker is down: this hit goes unaudited, the call is served
            log.warning("could not queue the audit of node %s of task %s: %s", node_id, task_id, exc)

    try:
        transaction.on_commit(send)
    except Exception as exc:
        log.warning("could not queue the audit of node %s of task %s: %s", node_id, task_id, exc)


def hit_audit(*, task_id: str, node_id: int, rollout_pk: int, applied: int) -> str:
    """Re-execute node `node_id`'s call at its parent state and compare: "equal", "divergent"
    (recorded), "inconclusive" (the sandbox failed, or a call timed out) or "skipped" (the node,
    the rollout or the task's keys are gone, or the node is divergent already)."""
    node = Node.objects.filter(task_id=task_id, pk=node_id, divergent=False).first()
    rollout = Rollout.objects.filter(pk=rollout_pk, task_id=task_id).values_list("history", "rollout_id").first()
    task = Task.objects.filter(pk=task_id).first()
    if node is None or rollout is None or task is None or len(rollout[0]) < applied:
        return SKIPPED
    history = tuple(ToolCall.from_json(item) for item in rollout[0][:applied])
    call = ToolCall.from_json(node.call)
    handle = task_handle(task_id=task_id)
    last = task_chain(handle, CallContext(history, call, rollout[1], 0, None)).steps[-1]
    if (last.anchor, last.digest) != (node.anchor_key, node.call_digest):  # the task changed since the hit
        return SKIPPED
    backend = backend_named(handle.backend)
    writes = [item for item in history if handle.policy.for_tool(item.tool).mutates_state]
    try:
        observed = _reexecute(task, backend, writes, call)
    except SandboxError as exc:
        log.warning("audit of node %s of task %s inconclusive: %s", node_id, task_id, exc)
        return INCONCLUSIVE
    expected = orjson.loads(node.result_json)
    if observed is None:
        return INCONCLUSIVE
    seen, now = backend.audit_view(call.tool, expected), backend.audit_view(call.tool, observed)
    if seen is None or now is None:
        return INCONCLUSIVE
    if canonical_json(seen) == canonical_json(now):
        return EQUAL
    divergence_record(task_id=task_id, node_id=node_id, tool=call.tool, kind=Divergence.Kind.AUDIT,
                      expected=expected, observed=observed, rollout_id=rollout[1])
    return DIVERGENT


def _reexecute(task: Task, backend: SandboxBackend, writes: list[ToolCall], call: ToolCall) -> dict[str, Any] | None:
    """The call's result in a fresh sandbox of the task after `writes`; None if a replayed call
    left the state unknown (it timed out). A sandbox row accounts for the sandbox meanwhile (the
    pools page shows it; the orphan reaper spares it)."""
    row = Sandbox.objects.create(task=task, backend=backend.name, pool=Sandbox.Pool.ROOT, state=Sandbox.State.WARMING)
    started = time.perf_counter()
    try:
        sandbox = backend.start(task.env, labels=labels(task.pk, row.pk))
    except SandboxError as exc:
        set_state(row, Sandbox.State.FAILED, error=f"audit: {exc.code}: {exc.message}")
        raise
    set_state(row, Sandbox.State.LEASED, ref=sandbox.sandbox_id, ready_at=timezone.now(),
              start_ms=(time.perf_counter() - started) * 1000, lease_expires_at=idle_deadline())
    try:
        for write in writes:
            if backend.audit_view(write.tool, sandbox.execute(write.tool, write.args)) is None:
                return None
        return sandbox.execute(call.tool, call.args)
    finally:
        sandbox_stop(sandbox_id=row.pk)
