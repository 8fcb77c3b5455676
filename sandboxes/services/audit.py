"""Tool-server mode's determinism audit: a worker re-executes a sampled hit in a sandbox of its
own at the hit's parent state (a fresh sandbox of the task, then the state-changing calls of the
rollout's history before the hit) and compares the results (`SandboxBackend.audit_view`); a
difference is recorded by `cache.services.divergence_record`. The sandbox is removed afterwards.

The rollout that hit is never delayed: once the hit's transaction commits, the audit is offered to
the broker by a thread of its own (`job_offer`); a broker that cannot take it costs only that
audit (logged).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from django.utils import timezone

from cache.models import Divergence, Node, Rollout, Task
from cache.services import divergence_record, kept_history, replay_file_times, task_handle
from cache.services.lookup import task_chain
from cache.tcg import ToolCall, canonical_json
from cache.tcg.records import CallContext
from core.background import job_offer
from sandboxes.backends.base import SandboxBackend, SandboxError
from sandboxes.engines import engine_queue, engines_for
from sandboxes.handles import backend_named
from sandboxes.models import Sandbox

from .materialize import replay_restoring_times
from .pools import idle_deadline, sandbox_launch, sandbox_stop, set_state

log = logging.getLogger("tvcache.audit")

EQUAL, DIVERGENT, INCONCLUSIVE, SKIPPED = "equal", "divergent", "inconclusive", "skipped"


def hit_audit_enqueue(*, task_id: str, node_id: int, rollout_pk: int, applied: int, backend: str) -> None:
    """Have a worker audit the hit of node `node_id` by the rollout whose history's first `applied`
    calls led to it, once the current transaction commits. Never waits: a broker that cannot take
    it costs only this audit (audits are samples). The audit's sandbox goes to the engine a new
    sandbox would go to now, and the audit to the queue of the workers next to that engine."""
    engine = engines_for(backend, 1)[0]
    job_offer("workers.tasks.hit_audit", task_id, node_id, rollout_pk, applied, engine, near=engine_queue(engine))


def hit_audit(*, task_id: str, node_id: int, rollout_pk: int, applied: int, engine: str = "") -> str:
    """Re-execute node `node_id`'s call at its parent state and compare: "equal", "divergent"
    (recorded), "inconclusive" (the sandbox failed, a call timed out, the replay missed the parent's
    state) or "skipped" (the node, the rollout or the task's keys are gone, or the node is divergent
    already). The audit's sandbox goes to `engine` (a docker engine's name)."""
    node = Node.objects.defer("file_times").filter(task_id=task_id, pk=node_id, divergent=False).first()
    rollout = Rollout.objects.filter(pk=rollout_pk, task_id=task_id).values_list("history_length", "rollout_id").first()
    task = Task.objects.filter(pk=task_id).first()
    if node is None or rollout is None or task is None or rollout[0] < applied:
        return SKIPPED
    history, rollout_id = kept_history(rollout_pk, applied), rollout[1]
    call = ToolCall.from_json(node.call)
    handle = task_handle(task_id=task_id)
    context = CallContext(history, call, rollout_id, 0, None)
    last = task_chain(handle, context).steps[-1]
    if (last.anchor, last.digest) != (node.anchor_key, node.call_digest):  # the task changed since the hit
        return SKIPPED
    backend = backend_named(handle.backend)
    writes = [item for item in history if handle.policy.for_tool(item.tool).mutates_state]
    parent = (
        Node.objects.filter(task_id=task_id, mutates=True, state_key=node.anchor_key)
        .values("pk", "tool", "state_shape")
        .first()
        if writes
        else None
    )
    times = replay_file_times(task_id=task_id, context=context, calls=writes)
    try:
        run = _reexecute(
            task,
            backend,
            engine,
            writes,
            times,
            call,
            parent,
            rollout_id,
            shape=node.mutates and bool(node.state_shape),
        )
    except SandboxError as exc:
        log.warning("audit of node %s of task %s inconclusive: %s", node_id, task_id, exc)
        return INCONCLUSIVE
    outcome = INCONCLUSIVE if run is None else _compared(backend, node, *run)
    if isinstance(outcome, str):
        return outcome
    divergence_record(
        task_id=task_id,
        node_id=node_id,
        tool=call.tool,
        kind=Divergence.Kind.AUDIT,
        expected=outcome[0],
        observed=outcome[1],
        rollout_id=rollout_id,
    )
    return DIVERGENT


def _compared(backend: SandboxBackend, node: Node, observed: dict[str, Any], shape: str | None) -> tuple | str:
    """(expected, observed) where the re-execution differs from the node, else EQUAL or
    INCONCLUSIVE. A state-changing call is also compared by the state it left (its shape: the
    re-execution runs at another time), so that a write whose effect is random, not its output,
    is found too."""
    expected = orjson.loads(node.result_json)
    seen, now = backend.audit_view(node.tool, expected), backend.audit_view(node.tool, observed)
    if seen is None or now is None:
        return INCONCLUSIVE
    if canonical_json(seen) != canonical_json(now):
        return expected, observed
    if shape is not None and shape != node.state_shape:
        return {"state_shape": node.state_shape, "result": expected}, {"state_shape": shape, "result": observed}
    return EQUAL


def _reexecute(
    task: Task,
    backend: SandboxBackend,
    engine: str,
    writes: list[ToolCall],
    times: list,
    call: ToolCall,
    parent: dict | None,
    rollout_id: str,
    *,
    shape: bool,
) -> tuple[dict[str, Any], str | None] | None:
    """The call's result in a fresh sandbox of the task after `writes` (each call with the file
    times its live run left, written back after it), and with `shape` the shape
    of the state it left; None if the replay did not reach the parent node's state: a replayed
    call timed out, or the sandbox's state differs from the one the parent recorded (a divergence
    of kind "state", recorded on the parent: the audited node is not judged). A sandbox row
    accounts for the sandbox meanwhile (the pools page shows it; the orphan reaper spares it)."""
    row = Sandbox.objects.create(
        task=task, backend=backend.name, engine=engine, pool=Sandbox.Pool.ROOT, state=Sandbox.State.WARMING
    )
    started = time.perf_counter()
    try:
        sandbox = sandbox_launch(row, task.env)
    except SandboxError as exc:
        set_state(row, Sandbox.State.FAILED, error=f"audit: {exc.code}: {exc.message}")
        raise
    set_state(
        row,
        Sandbox.State.LEASED,
        ref=sandbox.sandbox_id,
        ready_at=timezone.now(),
        start_ms=(time.perf_counter() - started) * 1000,
        lease_expires_at=idle_deadline(),
    )
    try:
        if not replay_restoring_times(
            sandbox, writes, times, ran=lambda call, result: backend.audit_view(call.tool, result) is not None
        ):
            return None
        if not _reached(sandbox, parent, task, rollout_id):
            return None
        result = sandbox.execute(call.tool, call.args)
        state = sandbox.state_fingerprint() if shape else None
        return result, state.shape if state is not None else None
    finally:
        sandbox_stop(sandbox_id=row.pk)


def _reached(sandbox, parent: dict | None, task: Task, rollout_id: str) -> bool:
    """Whether the replayed sandbox is in the parent node's recorded state, where both are known
    (a replay is compared by shape: it ran at another time, see StateDigest)."""
    if parent is None or not parent["state_shape"]:
        return True
    state = sandbox.state_fingerprint()
    if state is None or state.shape == parent["state_shape"]:
        return True
    divergence_record(
        task_id=task.pk,
        node_id=parent["pk"],
        tool=parent["tool"],
        kind=Divergence.Kind.STATE,
        expected={"fingerprint": parent["state_shape"]},
        observed={"fingerprint": state.shape, "sandbox": "audit", "why": "an audit's replay"},
        rollout_id=rollout_id,
    )
    return False
