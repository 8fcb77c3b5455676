"""Serving a verl-tool request through the tool call graph, in front of the user's own server.

Each trajectory id is a rollout of its task, whose history the service keeps (as in tool-server
mode), and each item goes through the rollout protocol (cache/tcg/rollout.py), this module doing
its I/O for a whole request at once. An item is served, in this order of preference:

- a hit: answered from the graph; the upstream never sees it. A state-changing hit is added to
  the trajectory's history and kept as pending for the upstream;
- a miss: sent to the upstream, after the trajectory's pending items (catch-up, one request each,
  in order, their observations dropped), and recorded. Of the trajectories that miss on the same
  call in the same state at once, one asks the upstream; the others wait and take its answer;
- as is: a `finish`, an item of a trajectory off the shared graph, or of one never seen.
Misses that need no catch-up go to the upstream together, in one request; the others go at the
same time, each trajectory on its own. The answer is one response for the whole request.

Known-state rule: an upstream that does not answer (refused, timed out, an error status, a body
that is not verl-tool's), or whose tool fails, leaves the trajectory's state unknown. The item is
answered as verl-tool's own server answers for a failed tool, and the trajectory leaves the shared
graph: its later actions pass through, uncached and unrecorded."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from cache.models import Rollout
from cache.services import (
    Flight,
    LookupHit,
    LookupMiss,
    TaskHandle,
    hit_count,
    looked,
    lookup_count,
    node_record,
    rollout_claim,
    rollout_detach,
    rollout_history_append,
    rollout_unclaim,
    task_handle,
    tcg_lookup,
)
from cache.tcg import ToolCall
from cache.tcg.records import CallContext, CallRecord
from cache.tcg.rollout import Act, Ran, RolloutCall, Step
from core.errors import Conflict, NotFound, PayloadTooLarge
from upstreams.models import Trajectory, Upstream

from .calls import action_call, passthrough_call, task_ensure, task_id_for, task_values
from .protocol import ActionItem, Observation, UpstreamFailure, failed, request_parse, response_body, upstream_post
from .registry import upstream_by_secret

log = logging.getLogger("tvcache.upstreams")

# How a slot is served once it is not a hit.
MISS, PASSTHROUGH, FINISH, AS_IS = "miss", "passthrough", "finish", "as_is"
_exchanges = ThreadPoolExecutor(max_workers=64, thread_name_prefix="tvcache-upstream")

PENDING_SQL = "UPDATE upstreams_trajectory SET pending = pending || %s::jsonb WHERE id = %s"


def observations_serve(*, secret: str, payload: Any) -> dict:
    """The verl-tool answer to a trainer's request sent to the upstream's proxy path."""
    upstream = upstream_by_secret(secret=secret)
    items = request_parse(payload)
    started = time.perf_counter()
    batch = _Batch(upstream)
    try:
        answers = batch.serve(items)
    finally:
        batch.count()
    return response_body(answers, processing_ms=(time.perf_counter() - started) * 1000, queue_ms=batch.wait_ms)


@dataclass
class _Slot:
    """One item being served."""

    index: int
    item: ActionItem
    route: str = AS_IS
    trajectory: Trajectory | None = None
    task: TaskHandle | None = None
    rollout: Rollout | None = None  # claimed by this request
    history: tuple[ToolCall, ...] = ()
    call: ToolCall | None = None
    answer: Observation | None = None
    lookup: LookupHit | LookupMiss | None = None
    flight: Flight | None = None  # the single-flight claim this slot holds
    waited: bool = False  # for another trajectory's execution of the same call
    protocol: RolloutCall | None = None  # the rollout protocol's decisions for the slot's call
    step: Step | None = None  # its next one

    @property
    def context(self) -> CallContext:
        return CallContext(self.history, self.call, self.item.trajectory_id, 0, None)

    @property
    def catch_up(self) -> list[ActionItem]:
        if self.route not in (MISS, PASSTHROUGH):
            return []
        return [ActionItem.from_json(data) for data in self.trajectory.pending]


@dataclass
class _Exchange:
    """What goes to the upstream for some slots: catch-up items one by one, then the slots' items
    in one request."""

    slots: list[_Slot]
    catch_up: list[ActionItem]
    answers: list[Observation] = field(default_factory=list)
    exec_ms: float = 0.0
    requests: int = 0
    error: str = ""


class _Batch:
    def __init__(self, upstream: Upstream):
        self.upstream = upstream
        self.hits = self.misses = self.passed = self.requests = self.errors = 0
        self.wait_ms = 0.0

    def serve(self, items: list[ActionItem]) -> list[Observation]:
        answers: list[Observation | None] = [None] * len(items)
        for indices in _rounds(items):  # a trajectory's items in a request are served in order
            slots = [_Slot(index, items[index]) for index in indices]
            try:
                self._open(slots)
                self._serve(slots)
            finally:
                self._close(slots)
            for slot in slots:
                answers[slot.index] = slot.answer
        return answers

    def count(self) -> None:
        Upstream.objects.filter(pk=self.upstream.pk).update(
            hits=F("hits") + self.hits,
            misses=F("misses") + self.misses,
            passed_through=F("passed_through") + self.passed,
            upstream_requests=F("upstream_requests") + self.requests,
            upstream_errors=F("upstream_errors") + self.errors,
        )

    # Opening: the trajectories, their rollouts (claimed) and the lookups.

    def _open(self, slots: list[_Slot]) -> None:
        ids = [slot.item.trajectory_id for slot in slots]
        rows = {
            row.trajectory_id: row
            for row in Trajectory.objects.filter(upstream=self.upstream, trajectory_id__in=ids).select_related(
                "rollout"
            )
        }
        for slot in slots:
            slot.trajectory = rows.get(slot.item.trajectory_id)
            if slot.item.finish:
                slot.route = FINISH
                continue
            try:
                self._claim(slot)
            except Conflict as exc:  # the same trajectory in two requests at once: the trainer broke the order
                log.warning(
                    "trajectory %s of upstream %s: %s", slot.item.trajectory_id, self.upstream.name, exc.message
                )
                slot.answer = failed(exc.message)
                continue
            slot.call = action_call(self.upstream, slot.item)
            servable = slot.call is not None
            slot.step = slot.protocol.start(servable=servable)
            if slot.step.act is Act.RUN_AS_IS:  # off the shared graph
                slot.route, slot.call = AS_IS, None
            elif not servable:  # no tool parses it: passed on, recorded as a passthrough, never served
                slot.route, slot.call = PASSTHROUGH, passthrough_call(self.upstream, slot.item)
            elif slot.step.act is Act.LOOKUP:
                self._lookup(slot)

    def _claim(self, slot: _Slot) -> None:
        """The slot's trajectory and rollout, created on first sight, claimed for this request.
        A trajectory id seen again after its finish starts afresh (the upstream dropped its env)."""
        item, row = slot.item, slot.trajectory
        values = task_values(self.upstream, item)
        if row is not None and row.rollout.finished_at is not None:
            row.rollout.delete()
            row = None
        if row is None:
            values = values or dict.fromkeys(self.upstream.task_fields)
            slot.task = task_ensure(upstream=self.upstream, values=values)
            try:
                claim = self._claim_rollout(slot)
            except NotFound:  # the task was deleted since this process made sure of it
                slot.task = task_ensure(upstream=self.upstream, values=values, fresh=True)
                claim = self._claim_rollout(slot)
            row, _ = Trajectory.objects.get_or_create(
                upstream=self.upstream, trajectory_id=item.trajectory_id, defaults={"rollout_id": claim.rollout.pk}
            )
        else:
            slot.task = task_handle(task_id=row.rollout.task_id, cached=True)
            claim = self._claim_rollout(slot)
        slot.trajectory = row
        detached = claim.detached
        if not detached and values is not None and task_id_for(self.upstream, values) != slot.task.task_id:
            rollout_detach(rollout=slot.rollout, reason="its extra fields name another task than its first action's")
            detached = True
        slot.protocol = RolloutCall(detached=detached)  # the upstream's state cannot be rebuilt here
        slot.route = MISS

    @staticmethod
    def _claim_rollout(slot: _Slot):
        claim = rollout_claim(task_id=slot.task.task_id, rollout_id=slot.item.trajectory_id)
        slot.rollout, slot.history = claim.rollout, claim.history  # unclaimed by _close, whatever happens next
        return claim

    def _lookup(self, slot: _Slot) -> None:
        """The slot's call looked up after its history: served if it hits."""
        slot.lookup = tcg_lookup(task_id=slot.task.task_id, context=slot.context, count=False, resume=False)
        slot.step = slot.protocol.looked_up(looked(task=slot.task, context=slot.context, answer=slot.lookup))
        if slot.step.act is Act.SERVE:
            if slot.flight is not None:  # its leader recorded it meanwhile
                slot.flight.release()
                slot.flight = None
            self._hit(slot, slot.lookup, append=slot.step.append)

    def _hit(self, slot: _Slot, hit: LookupHit, *, append: bool) -> None:
        hit_count(task_id=slot.task.task_id, context=slot.context, hit=hit)
        slot.answer = Observation.from_result(orjson.loads(hit.result_json))
        self.hits += 1
        if append:  # the upstream has not run it: it goes with the trajectory's next miss
            with transaction.atomic():
                rollout_history_append(rollout_pk=slot.rollout.pk, call=slot.call, length=len(slot.history))
                with connection.cursor() as cursor:
                    cursor.execute(PENDING_SQL, [orjson.dumps([slot.item.to_json()]).decode(), slot.trajectory.pk])
            slot.history += (slot.call,)
            slot.trajectory.pending.append(slot.item.to_json())

    # Serving: single flight among misses, the upstream for the rest.

    def _serve(self, slots: list[_Slot]) -> None:
        """In passes: the first asks the upstream for every miss this request leads and for the
        items that go as they are; a miss whose call another trajectory is asking for (in this
        request or another) waits for it in a later pass and is then, most often, a hit."""
        todo = [slot for slot in slots if slot.answer is None]
        while todo:
            forward, later, leading = [], [], set()
            for slot in todo:
                if slot.step is not None and slot.step.act in (Act.LEAD, Act.AWAIT):
                    key = slot.step.key
                    if key in leading:  # the same call in the same state as an earlier slot's: after it
                        if slot.step.act is Act.LEAD:
                            slot.step = slot.protocol.lead_tried(False, key)
                        later.append(slot)
                        continue
                    leading.add(key)
                    self._fly(slot)
                    if slot.step.act is Act.AWAIT:
                        later.append(slot)
                        continue
                    if slot.step.act is not Act.EXECUTE:  # a hit now
                        continue
                forward.append(slot)
            self._forward(forward)
            todo = later

    def _fly(self, slot: _Slot) -> None:
        """Single flight: lead the slot's call, or wait while another request leads it (a slot
        seen waiting in an earlier pass), then look it up again."""
        key, flight = slot.step.key, Flight(slot.step.key, slot.lookup, slot.item.trajectory_id)
        if slot.step.act is Act.LEAD:
            led = flight.try_lead()
            slot.step = slot.protocol.lead_tried(led, key)
        else:
            started = time.perf_counter()
            led = flight.wait_to_lead()
            self.wait_ms += (time.perf_counter() - started) * 1000
            slot.waited = True
            slot.step = slot.protocol.awaited(timed_out=not led)
        slot.flight = flight if led else None
        if slot.step.act is Act.LOOKUP:
            self._lookup(slot)

    def _forward(self, slots: list[_Slot]) -> None:
        together = [slot for slot in slots if not slot.catch_up]
        exchanges = [_Exchange(together, [])] if together else []
        exchanges += [_Exchange([slot], slot.catch_up) for slot in slots if slot.catch_up]
        if len(exchanges) == 1:
            self._exchange(exchanges[0])
        else:
            list(_exchanges.map(self._exchange, exchanges))
        for exchange in exchanges:
            self._settle(exchange)

    def _exchange(self, exchange: _Exchange) -> None:
        """Run in a thread of its own when there are several: the upstream only, no database."""
        upstream = self.upstream
        try:
            for item in exchange.catch_up:
                exchange.requests += 1
                answer = upstream_post(url=upstream.url, items=[item], timeout_s=upstream.timeout_s)[0][0]
                if not answer.valid:
                    raise UpstreamFailure(
                        f"it answered the catch-up action {item.action[:80]!r} as invalid, which "
                        "it had answered valid for another trajectory"
                    )
            exchange.requests += 1
            exchange.answers, exchange.exec_ms = upstream_post(
                url=upstream.url, items=[s.item for s in exchange.slots], timeout_s=upstream.timeout_s
            )
        except UpstreamFailure as exc:
            exchange.error = str(exc)

    # Settling: the upstream's answers recorded, histories and trajectories brought up to date.

    def _settle(self, exchange: _Exchange) -> None:
        self.requests += exchange.requests
        if exchange.error:
            self.errors += 1
            log.error(
                "upstream %s (%s) failed for trajectories %s: %s; answered as a failed tool, and the "
                "trajectories leave the shared graph",
                self.upstream.name,
                self.upstream.url,
                ", ".join(s.item.trajectory_id for s in exchange.slots),
                exchange.error,
            )
            for slot in exchange.slots:
                slot.answer = failed(f"upstream '{self.upstream.name}' did not answer: {exchange.error}")
                self._counted(slot)
                if slot.route in (MISS, PASSTHROUGH):
                    step = slot.protocol.executed(
                        Ran.ENV_FAILED, reason=f"the upstream did not answer: {exchange.error}"
                    )
                    self._unrecorded(slot, step)
            return
        for slot, answer in zip(exchange.slots, exchange.answers):
            slot.answer = answer
            self._counted(slot)
            if slot.route == FINISH:
                _rollout_end(slot.trajectory)
            elif slot.route in (MISS, PASSTHROUGH):
                self._record(slot, answer, exchange.exec_ms)

    def _counted(self, slot: _Slot) -> None:
        if slot.route == MISS:
            lookup_count(
                task_id=slot.task.task_id,
                context=slot.context,
                node_id=None,
                hit=False,
                seen=bool(slot.lookup and slot.lookup.seen) or slot.waited,
                saved_ms=0.0,
            )
            self.misses += 1
        else:
            self.passed += 1

    def _record(self, slot: _Slot, answer: Observation, exec_ms: float) -> None:
        """The answer filed under the trajectory's history: the call itself if the upstream found
        it valid, else as a passthrough (never served). The upstream has now applied the whole
        history. A tool that failed part way leaves the trajectory's state unknown."""
        if answer.tool_failed and not self.upstream.read_only:
            reason = "the upstream's tool failed part way: the trajectory's state is unknown"
            self._unrecorded(slot, slot.protocol.executed(Ran.UNKNOWN, reason=reason))
            return
        slot.protocol.executed(Ran.KNOWN)
        call = slot.call if slot.route == MISS and answer.valid else passthrough_call(self.upstream, slot.item)
        context = CallContext(slot.history, call, slot.item.trajectory_id, 0, None)
        try:
            mutates = node_record(
                task_id=slot.task.task_id, record=CallRecord(context, answer.to_result(), exec_ms)
            ).mutates
        except PayloadTooLarge:  # answered, not cached; the history still has it
            mutates = slot.task.policy.for_tool(call.tool).mutates_state
        if slot.flight is not None:
            slot.flight.release()  # the trajectories waiting for this call take it from the graph now
            slot.flight = None
        append = slot.protocol.recorded(mutates=mutates).append
        with transaction.atomic():
            if append:
                rollout_history_append(rollout_pk=slot.rollout.pk, call=call, length=len(slot.history))
                slot.history += (call,)
            Trajectory.objects.filter(pk=slot.trajectory.pk).update(applied=len(slot.history), pending=[])
        slot.trajectory.pending = []

    def _unrecorded(self, slot: _Slot, step: Step) -> None:
        """Known-state rule: nothing recorded, and the trajectory leaves the shared graph (an
        upstream's state cannot be rebuilt from the history here)."""
        rollout_detach(rollout=slot.rollout, reason=step.reason)

    def _close(self, slots: list[_Slot]) -> None:
        for slot in slots:
            if slot.protocol is not None:
                slot.protocol.logged(slot.item.trajectory_id)
            if slot.flight is not None:
                slot.flight.release()
            if slot.rollout is not None:
                if slot.item.is_last_step:
                    _rollout_end(slot.trajectory)
                rollout_unclaim(rollout_pk=slot.rollout.pk)


def _rollout_end(trajectory: Trajectory | None) -> None:
    if trajectory is not None:
        Rollout.objects.filter(pk=trajectory.rollout_id, finished_at__isnull=True).update(finished_at=timezone.now())


def _rounds(items: list[ActionItem]) -> list[list[int]]:
    """Indices of the items in rounds where each trajectory comes once: its k-th item in round k."""
    rounds: list[list[int]] = []
    seen: dict[str, int] = defaultdict(int)
    for index, item in enumerate(items):
        k = seen[item.trajectory_id]
        seen[item.trajectory_id] += 1
        if k == len(rounds):
            rounds.append([])
        rounds[k].append(index)
    return rounds
