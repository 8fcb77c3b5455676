"""Typed answers of the trainer's hot-path endpoints.

Lookup, record, snapshot registration and tool-server calls answer with frozen dataclasses
because the executor branches on their fields. Descriptive resources (tasks, graph, stats,
pools) are returned as plain dicts: they are read by people and grow with the server.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

Call = dict[str, Any]  # {"tool": str, "args": {...}}
ToolResult = dict[str, Any]  # whatever the tool answered; a JSON object

_INT_RANGE = range(-(2**63), 2**64)  # what the service's JSON parser takes


def inexact_json(value: Any, where: str = "result") -> str | None:
    """Why `value` would not come back from the cache equal and of the same types, or None.

    A result is served as the JSON it was recorded as: only dicts with str keys, lists, str,
    bool, None, ints the service can hold and finite floats, each of exactly that type, come
    back as they went. A tuple would come back a list, an int key a str key, a str subclass a
    str: the model would see another observation, so such a result is not cached (the rule
    every integration shares; ToolCallExecutor runs the call uncached).
    """
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        kind = type(item)
        if item is None or kind is bool:
            continue
        if kind is str:
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return f"{path} is a str with a lone surrogate"
        elif kind is int:
            if item not in _INT_RANGE:
                return f"{path} is an int beyond 64 bits"
        elif kind is float:
            if not math.isfinite(item):
                return f"{path} is {item!r}"
        elif kind is list:
            stack.extend((element, f"{path}[{index}]") for index, element in enumerate(item))
        elif kind is dict:
            for key, element in item.items():
                if type(key) is not str:
                    return f"{path} has a {type(key).__name__} key {key!r}"
                stack.append((element, f"{path}[{key!r}]"))
        else:
            return f"{path} is a {kind.__module__}.{kind.__qualname__}"
    return None


def _calls(data: Any) -> tuple[Call, ...]:
    return tuple(dict(call) for call in data)


@dataclass(frozen=True, slots=True)
class Resume:
    """The deepest matched node with a live snapshot, held for us by a lease until released."""

    node_id: int
    snapshot_id: int
    snapshot_ref: str
    lease_id: int | str
    replay: tuple[Call, ...]  # state-changing calls after the snapshot, to replay on its fork

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Resume:
        return cls(
            node_id=data["node_id"],
            snapshot_id=data["snapshot_id"],
            snapshot_ref=data["snapshot_ref"],
            lease_id=data["lease_id"],
            replay=_calls(data["replay"]),
        )


@dataclass(frozen=True, slots=True)
class LookupResult:
    hit: bool
    node_id: int | None = None
    result: ToolResult | None = None
    matched: int = 0
    resume: Resume | None = None
    replay: tuple[Call, ...] = ()  # every state-changing call of the history, for a fresh sandbox
    # Hits: False when the call left the state as it was; it need not join the history sent.
    mutates: bool = True
    # Misses of lookups with claim=True: "granted" (this rollout executes and records the call) or
    # "in_flight" (another rollout is executing it in this state: look up again shortly).
    claim: str | None = None
    # Hits: sampled for the determinism audit (the task's audit_rate). An executor whose
    # environment is at the hit's parent state re-executes the call and reports the result.
    audit: bool = False
    # Misses: a call that changes the state and runs longer than this will most likely be asked
    # for a snapshot by its record (None: it will not); the record's answer is the one that counts.
    snapshot_after_ms: float | None = None
    # The service's own time on the lookup in ms (its Server-Timing header), None if it did not
    # say: the rest of the round trip is the network and the client.
    server_ms: float | None = field(default=None, compare=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LookupResult:
        if data["hit"]:
            return cls(
                hit=True,
                node_id=data["node_id"],
                result=data["result"],
                mutates=bool(data.get("mutates", True)),
                audit=bool(data.get("audit", False)),
            )
        resume = data.get("resume")
        return cls(
            hit=False,
            node_id=data.get("node_id"),
            matched=data["matched"],
            resume=Resume.from_json(resume) if resume is not None else None,
            replay=_calls(data["replay"]),
            claim=data.get("claim"),
            snapshot_after_ms=data.get("snapshot_after_ms"),
        )


@dataclass(frozen=True, slots=True)
class RecordResult:
    node_id: int
    created: bool
    snapshot: str  # "wanted" | "skipped"
    evicted: tuple[str, ...]  # refs of client-owned snapshots to stop now
    mutates: bool = True  # the node's: False if the call is recorded as read-only

    @property
    def snapshot_wanted(self) -> bool:
        return self.snapshot == "wanted"

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RecordResult:
        return cls(
            node_id=data["node_id"],
            created=bool(data.get("created", False)),
            snapshot=data["snapshot"],
            evicted=tuple(data.get("evicted", ())),
            mutates=bool(data.get("mutates", True)),
        )


@dataclass(frozen=True, slots=True)
class SnapshotRegistration:
    snapshot_id: int
    ref: str
    evicted: tuple[str, ...]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SnapshotRegistration:
        return cls(
            snapshot_id=data["snapshot_id"],
            ref=data["ref"],
            evicted=tuple(data.get("evicted", ())),
        )


@dataclass(frozen=True, slots=True)
class CallResult:
    """Answer of a tool-server mode call."""

    result: ToolResult
    cached: bool
    node_id: int
    latency_ms: float
    mutates: bool = True  # the call changed the rollout's state (False: read-only, declared or observed)
    # Where the service spent the call's time, by phase (lanes, claim, lookup, wait, prepare,
    # materialize, replay, verify, exec, fingerprint, record, snapshot, ...); a phase the call did
    # not go through is absent.
    phases_ms: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CallResult:
        return cls(
            result=data["result"],
            cached=data["cached"],
            node_id=data["node_id"],
            latency_ms=data["latency_ms"],
            mutates=bool(data.get("mutates", True)),
            phases_ms=dict(data.get("phases_ms") or {}),
        )
