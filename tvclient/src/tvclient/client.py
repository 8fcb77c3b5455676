"""Sync and async HTTP clients for the tvcache REST API v1.

Both clients keep one keep-alive connection pool for their lifetime; create one per trainer
process (or per event loop) and share it between rollouts.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from . import operations
from .errors import TVCacheUnavailable
from .operations import Operation
from .results import (
    Call,
    CallResult,
    LookupResult,
    RecordResult,
    SnapshotRegistration,
    ToolResult,
)
from .retry import Availability, RetryPolicy
from .transport import Connections, Reply, TransportFailure, server_ms

T = TypeVar("T")

Tools = Mapping[str, Mapping[str, bool]]  # {name: {"mutates_state": bool, "cacheable": bool}}


@dataclass(frozen=True)
class TaskSpec:
    """What `put_task` says of a task: its environment, tool declarations and sandbox budget.
    Executors given one register their task before their first lookup (`ensure_task`)."""

    env: Mapping[str, Any]
    tools: Tools | None = None
    sandbox_budget: int | None = None
    audit_rate: float | None = None
    match: str | None = None  # "history" or "state" (None: the task's, or the service's default)

    def key(self, task_id: str) -> str:
        return json.dumps(
            [task_id, self.env, self.tools, self.sandbox_budget, self.audit_rate, self.match],
            sort_keys=True,
            default=repr,
        )


def _headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Token {token}", "Accept": "application/json"}


def _request(operation: Operation[Any]) -> dict[str, Any]:
    return {
        "method": operation.method,
        "url": operation.path,
        "json": operation.body,
        "params": operation.params,
    }


class TVCacheClient:
    """The REST API over keep-alive connections, one per calling thread (tvclient.transport):
    share one client between the rollouts of a process."""

    def __init__(self, base_url: str, token: str, timeout: float = 30.0, retry: RetryPolicy | None = None) -> None:
        self._http = Connections(base_url, _headers(token), timeout)
        self.availability = Availability(retry or RetryPolicy.from_environment())
        self._registered: set[str] = set()  # TaskSpec keys put by this client
        self._registering = threading.Lock()

    def _send(self, operation: Operation[T]) -> T:
        """The operation's answer, retried while the service is unavailable (tvclient.retry)."""
        attempt = self.availability.attempt()
        while True:
            try:
                answer = self._send_once(operation)
            except TVCacheUnavailable as exc:
                delay = attempt.wait(exc)
                if delay is None:
                    raise
                time.sleep(delay)
            else:
                self.availability.succeeded()
                return answer

    def _send_once(self, operation: Operation[T]) -> T:
        try:
            reply = self._http.request(operation.method, operation.path, operation.body, operation.params)
        except TransportFailure as exc:
            raise operations.unavailable(operation, exc) from exc
        return operations.read_response(operation, reply)

    def ensure_task(self, task_id: str, spec: TaskSpec) -> None:
        """`put_task` once per task and spec for this client: every rollout of a task sends the
        same spec, and a PUT with an unchanged spec keeps the graph."""
        key = spec.key(task_id)
        if key in self._registered:
            return
        with self._registering:
            if key not in self._registered:
                self.put_task(task_id, spec.env, spec.tools, spec.sandbox_budget, spec.audit_rate, spec.match)
                self._registered.add(key)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> TVCacheClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def put_task(
        self,
        task_id: str,
        env: Mapping[str, Any],
        tools: Tools | None = None,
        sandbox_budget: int | None = None,
        audit_rate: float | None = None,
        match: str | None = None,
    ) -> dict[str, Any]:
        """`audit_rate`: the fraction of hits sampled for the determinism audit (0 to 1; the
        service's default, 0.02, when None). `match`: "history" (a hit needs the rollout's
        history) or "state" (also from a state with the same verified fingerprint); None keeps
        the task's (a new task: the service's default)."""
        return self._send(operations.put_task(task_id, env, tools, sandbox_budget, audit_rate, match))

    def get_task(self, task_id: str) -> dict[str, Any]:
        return self._send(operations.get_task(task_id))

    def list_tasks(self, search: str | None = None) -> list[dict[str, Any]]:
        """Every task (whose id contains `search`), with its totals, fetched a page at a time
        (until a page names no later one)."""
        tasks: list[dict[str, Any]] = []
        offset: int | None = 0
        while offset is not None:
            page, following = self._send(operations.list_tasks(search, offset))
            tasks += page
            offset = following if following is not None and following > offset else None
        return tasks

    def lookup(
        self,
        task_id: str,
        history: list[Call],
        call: Call,
        *,
        rollout_id: str | None = None,
        epoch: int | None = None,
        claim: bool = False,
        resume: bool = True,
        trace: Mapping[str, Any] | None = None,
    ) -> LookupResult:
        """`claim` (needs rollout_id): on a miss, claim the call for this rollout; see
        LookupResult.claim. `resume=False`: the caller's environment already follows the
        history, so a miss offers (and leases) no snapshot to fork. `trace`: the call's fields
        for the rollout tree export (`trajectory_ref`, `tokens`, `seq`, `branch_of`)."""
        return self._send(operations.lookup(task_id, history, call, rollout_id, epoch, claim, resume, trace))

    def record(
        self,
        task_id: str,
        history: list[Call],
        call: Call,
        result: ToolResult,
        exec_ms: float,
        *,
        rollout_id: str | None = None,
        epoch: int | None = None,
        mutated: bool | None = None,
        file_times: Mapping[str, int] | None = None,
        replay: bool = False,
        trace: Mapping[str, Any] | None = None,
    ) -> RecordResult:
        """`file_times`: the modification times (ns, by path) of what the call changed, written
        back after each later replay of it (ToolExecutionEnvironment.file_times). `replay`: the
        call ran again only to rebuild a sandbox's state (its time was not saved). `trace`: as
        for `lookup`."""
        return self._send(
            operations.record(
                task_id, history, call, result, exec_ms, rollout_id, epoch, mutated, file_times, replay, trace
            )
        )

    def register_snapshot(
        self,
        task_id: str,
        node_id: int,
        ref: str,
        backend: str,
        *,
        size_bytes: int | None = None,
        create_ms: float | None = None,
    ) -> SnapshotRegistration:
        return self._send(operations.register_snapshot(task_id, node_id, ref, backend, size_bytes, create_ms))

    def report_audit(self, task_id: str, node_id: int, result: ToolResult, *, rollout_id: str | None = None) -> bool:
        """Report a hit's call re-executed at the hit's parent state (determinism audit).
        True: the result differs from the node's, which the service no longer serves."""
        return self._send(operations.report_audit(task_id, node_id, result, rollout_id))

    def release_lease(self, lease_id: int | str, *, restore_ms: float | None = None) -> None:
        self._send(operations.release_lease(lease_id, restore_ms))

    def release_claim(self, task_id: str, history: list[Call], call: Call, *, rollout_id: str) -> bool:
        """Give up the claim a lookup took on the call (its execution failed)."""
        return self._send(operations.release_claim(task_id, history, call, rollout_id))

    def replay_file_times(
        self, task_id: str, history: list[Call], call: Call, replay: list[Call]
    ) -> list[dict[str, int] | None]:
        """For a replay of `replay` (the last state-changing calls of `history`) before `call`:
        the file times each left when it was recorded, to write back after replaying it (None
        where they were not kept: restore none from there on)."""
        return self._send(operations.replay_file_times(task_id, history, call, replay))

    def call(
        self,
        task_id: str,
        rollout_id: str,
        call: Call,
        *,
        epoch: int | None = None,
        trace: Mapping[str, Any] | None = None,
    ) -> CallResult:
        return self._send(operations.rollout_call(task_id, rollout_id, call, epoch, trace))

    def branch(
        self,
        task_id: str,
        origin: Mapping[str, Any],
        *,
        count: int | None = None,
        rollout_ids: list[str] | None = None,
        epoch: int | None = None,
        tokens: Mapping[str, Any] | None = None,
        trajectory_refs: list[str] | None = None,
    ) -> dict[str, Any]:
        """Start rollouts at `origin` ({"rollout": R, "step": k} or {"node_id": N}); in tool-server
        mode each has a sandbox in that state when this returns (docs/design/tree-search.md)."""
        return self._send(operations.branches(task_id, origin, count, rollout_ids, epoch, tokens, trajectory_refs))

    def tree_page(
        self, task_id: str, *, epoch: int | None = None, after: str | None = None, limit: int | None = None
    ) -> list[bytes]:
        """One page of the rollout tree export, as NDJSON lines (tvclient.trees reads them)."""
        return self._send(operations.tree_page(task_id, epoch, after, limit))

    def end_rollout(self, task_id: str, rollout_id: str) -> None:
        self._send(operations.end_rollout(task_id, rollout_id))

    def announce_step(self, tasks: list[str], rollouts_per_task: int, epoch: int) -> dict[str, Any]:
        return self._send(operations.announce_step(tasks, rollouts_per_task, epoch))

    def graph(self, task_id: str, after: str | None = None, limit: int | None = None) -> dict[str, Any]:
        """A page of the task's graph; `after`: the previous page's `next` (None on the last page)."""
        return self._send(operations.graph(task_id, after, limit))

    def stats(self, task_id: str) -> dict[str, Any]:
        return self._send(operations.stats(task_id))

    def pools(self, offset: int = 0, limit: int | None = None) -> dict[str, Any]:
        return self._send(operations.pools(offset, limit))

    def sandboxes(self, task_id: str) -> dict[str, Any]:
        return self._send(operations.sandboxes(task_id))


class AsyncTVCacheClient:
    """The same endpoints as TVCacheClient, awaitable, over one httpx.AsyncClient."""

    def __init__(
        self,
        base_url: str,
        token: str,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self._http = httpx.AsyncClient(
            base_url=base_url,
            headers=_headers(token),
            timeout=httpx.Timeout(timeout),
            transport=transport,
        )
        self.availability = Availability(retry or RetryPolicy.from_environment())

    async def _send(self, operation: Operation[T]) -> T:
        """The operation's answer, retried while the service is unavailable (tvclient.retry)."""
        attempt = self.availability.attempt()
        while True:
            try:
                answer = await self._send_once(operation)
            except TVCacheUnavailable as exc:
                delay = attempt.wait(exc)
                if delay is None:
                    raise
                await asyncio.sleep(delay)
            else:
                self.availability.succeeded()
                return answer

    async def _send_once(self, operation: Operation[T]) -> T:
        try:
            response = await self._http.request(**_request(operation))
        except httpx.TransportError as exc:
            raise operations.unavailable(operation, exc) from exc
        reply = Reply(
            response.status_code,
            response.content,
            response.reason_phrase,
            server_ms(response.headers.get("Server-Timing")),
            response.headers.get("Retry-After"),
        )
        return operations.read_response(operation, reply)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncTVCacheClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def put_task(
        self,
        task_id: str,
        env: Mapping[str, Any],
        tools: Tools | None = None,
        sandbox_budget: int | None = None,
        audit_rate: float | None = None,
        match: str | None = None,
    ) -> dict[str, Any]:
        return await self._send(operations.put_task(task_id, env, tools, sandbox_budget, audit_rate, match))

    async def get_task(self, task_id: str) -> dict[str, Any]:
        return await self._send(operations.get_task(task_id))

    async def list_tasks(self, search: str | None = None) -> list[dict[str, Any]]:
        tasks: list[dict[str, Any]] = []
        offset: int | None = 0
        while offset is not None:
            page, following = await self._send(operations.list_tasks(search, offset))
            tasks += page
            offset = following if following is not None and following > offset else None
        return tasks

    async def lookup(
        self,
        task_id: str,
        history: list[Call],
        call: Call,
        *,
        rollout_id: str | None = None,
        epoch: int | None = None,
        claim: bool = False,
        resume: bool = True,
        trace: Mapping[str, Any] | None = None,
    ) -> LookupResult:
        return await self._send(operations.lookup(task_id, history, call, rollout_id, epoch, claim, resume, trace))

    async def record(
        self,
        task_id: str,
        history: list[Call],
        call: Call,
        result: ToolResult,
        exec_ms: float,
        *,
        rollout_id: str | None = None,
        epoch: int | None = None,
        mutated: bool | None = None,
        file_times: Mapping[str, int] | None = None,
        replay: bool = False,
        trace: Mapping[str, Any] | None = None,
    ) -> RecordResult:
        return await self._send(
            operations.record(
                task_id, history, call, result, exec_ms, rollout_id, epoch, mutated, file_times, replay, trace
            )
        )

    async def register_snapshot(
        self,
        task_id: str,
        node_id: int,
        ref: str,
        backend: str,
        *,
        size_bytes: int | None = None,
        create_ms: float | None = None,
    ) -> SnapshotRegistration:
        return await self._send(operations.register_snapshot(task_id, node_id, ref, backend, size_bytes, create_ms))

    async def report_audit(
        self, task_id: str, node_id: int, result: ToolResult, *, rollout_id: str | None = None
    ) -> bool:
        return await self._send(operations.report_audit(task_id, node_id, result, rollout_id))

    async def release_lease(self, lease_id: int | str, *, restore_ms: float | None = None) -> None:
        await self._send(operations.release_lease(lease_id, restore_ms))

    async def release_claim(self, task_id: str, history: list[Call], call: Call, *, rollout_id: str) -> bool:
        return await self._send(operations.release_claim(task_id, history, call, rollout_id))

    async def replay_file_times(
        self, task_id: str, history: list[Call], call: Call, replay: list[Call]
    ) -> list[dict[str, int] | None]:
        return await self._send(operations.replay_file_times(task_id, history, call, replay))

    async def call(
        self,
        task_id: str,
        rollout_id: str,
        call: Call,
        *,
        epoch: int | None = None,
        trace: Mapping[str, Any] | None = None,
    ) -> CallResult:
        return await self._send(operations.rollout_call(task_id, rollout_id, call, epoch, trace))

    async def branch(
        self,
        task_id: str,
        origin: Mapping[str, Any],
        *,
        count: int | None = None,
        rollout_ids: list[str] | None = None,
        epoch: int | None = None,
        tokens: Mapping[str, Any] | None = None,
        trajectory_refs: list[str] | None = None,
    ) -> dict[str, Any]:
        return await self._send(
            operations.branches(task_id, origin, count, rollout_ids, epoch, tokens, trajectory_refs)
        )

    async def tree_page(
        self, task_id: str, *, epoch: int | None = None, after: str | None = None, limit: int | None = None
    ) -> list[bytes]:
        return await self._send(operations.tree_page(task_id, epoch, after, limit))

    async def end_rollout(self, task_id: str, rollout_id: str) -> None:
        await self._send(operations.end_rollout(task_id, rollout_id))

    async def announce_step(self, tasks: list[str], rollouts_per_task: int, epoch: int) -> dict[str, Any]:
        return await self._send(operations.announce_step(tasks, rollouts_per_task, epoch))

    async def graph(self, task_id: str, after: str | None = None, limit: int | None = None) -> dict[str, Any]:
        """A page of the task's graph; `after`: the previous page's `next` (None on the last page)."""
        return await self._send(operations.graph(task_id, after, limit))

    async def stats(self, task_id: str) -> dict[str, Any]:
        return await self._send(operations.stats(task_id))

    async def pools(self, offset: int = 0, limit: int | None = None) -> dict[str, Any]:
        return await self._send(operations.pools(offset, limit))

    async def sandboxes(self, task_id: str) -> dict[str, Any]:
        return await self._send(operations.sandboxes(task_id))
