"""A scripted stand-in for the remote tvcache service: an httpx-style handler, served on a
loopback port for the sync client (loopback.served) and through httpx.MockTransport for the async one.

Each test scripts the answers it needs per route; record, snapshot registration and lease
release have defaults that a real service could give. Every request is kept for assertions.
"""

from __future__ import annotations

import itertools
import json
import re
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

import httpx

ROUTES = [
    ("lookup", "POST", re.compile(r"^/api/v1/tasks/[^/]+/lookup$")),
    ("record", "POST", re.compile(r"^/api/v1/tasks/[^/]+/record$")),
    ("snapshot", "POST", re.compile(r"^/api/v1/tasks/[^/]+/nodes/\d+/snapshots$")),
    ("release", "DELETE", re.compile(r"^/api/v1/leases/[^/]+$")),
    ("release_claim", "POST", re.compile(r"^/api/v1/tasks/[^/]+/claims/release$")),
    ("audit", "POST", re.compile(r"^/api/v1/tasks/[^/]+/nodes/\d+/audit$")),
]


@dataclass(frozen=True)
class Seen:
    route: str
    path: str
    body: Any
    params: dict[str, str]


def call(tool: str, **args: Any) -> dict[str, Any]:
    return {"tool": tool, "args": args}


def hit(result: dict[str, Any], node_id: int = 1) -> dict[str, Any]:
    return {"hit": True, "node_id": node_id, "result": result}


def miss(
    replay: list[dict[str, Any]],
    resume: dict[str, Any] | None = None,
    matched: int = 0,
    snapshot_after_ms: float | None = None,
) -> dict[str, Any]:
    return {
        "hit": False,
        "matched": matched,
        "resume": resume,
        "replay": replay,
        "snapshot_after_ms": snapshot_after_ms,
    }


def resume(ref: str, replay: list[dict[str, Any]], lease_id: int = 7) -> dict[str, Any]:
    return {
        "node_id": 3,
        "snapshot_id": 4,
        "snapshot_ref": ref,
        "lease_id": lease_id,
        "replay": replay,
    }


class FakeService:
    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self._scripts: dict[str, deque[tuple[int, Any]]] = defaultdict(deque)
        self._ids = itertools.count(100)

    def script(self, route: str, body: Any, status: int = 200) -> None:
        self._scripts[route].append((status, body))

    def requests(self, route: str) -> list[Seen]:
        return [seen for seen in self.seen if seen.route == route]

    @staticmethod
    def route(request: httpx.Request) -> str:
        return next(
            name for name, method, pattern in ROUTES if request.method == method and pattern.match(request.url.path)
        )

    def handle(self, request: httpx.Request) -> httpx.Response:
        route = self.route(request)
        body = json.loads(request.content) if request.content else None
        self.seen.append(Seen(route, request.url.path, body, dict(request.url.params)))
        status, answer = self._scripts[route].popleft() if self._scripts[route] else self._default(route, body)
        return httpx.Response(status, json=answer) if answer is not None else httpx.Response(status)

    def _default(self, route: str, body: Any) -> tuple[int, Any]:
        if route == "record":
            node = {"node_id": next(self._ids), "created": True}
            return 200, {**node, "snapshot": "skipped", "evicted": []}
        if route == "snapshot":
            return 201, {"snapshot_id": next(self._ids), "ref": body["ref"], "evicted": []}
        if route == "release":
            return 204, None
        if route == "release_claim":
            return 200, {"released": True}
        raise AssertionError(f"no answer scripted for {route}")
