"""Canonical call encoding, digests and the state-key hash chain (docs/design/index.md, "Keys")."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class ToolCall:
    tool: str
    args: Mapping[str, Any]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ToolCall:
        return cls(tool=data["tool"], args=data["args"])

    def to_json(self) -> dict[str, Any]:
        return {"tool": self.tool, "args": dict(self.args)}


def canonical_json(value: Any) -> bytes:
    """JSON with sorted keys at every level and no whitespace."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def result_json(value: Any) -> bytes:
    """A result as it is stored and served: compact JSON with its objects' keys in the order the
    tool gave them. Never sorted: a policy that renders a dict as text would see other tokens."""
    return orjson.dumps(value)


def same_result(stored: str, observed: Any) -> bool:
    """Whether `observed` is the result a node stores: the same bytes. Results recorded before
    results kept their key order are stored with sorted keys: those compare by value."""
    return result_json(observed).decode() == stored or canonical_json(observed).decode() == stored


def canonical_call(call: ToolCall) -> bytes:
    return canonical_json({"tool": call.tool, "args": call.args})


def call_digest(call: ToolCall) -> str:
    return hashlib.sha256(canonical_call(call)).hexdigest()


def env_fingerprint(env_spec: Mapping[str, Any]) -> str:
    """Fingerprint of a task's environment spec: any change to it changes every state key."""
    return hashlib.sha256(canonical_json(env_spec)).hexdigest()


def root_state_key(fingerprint: str) -> str:
    return hashlib.sha256(bytes.fromhex(fingerprint)).hexdigest()


def next_state_key(state_key: str, digest: str) -> str:
    return hashlib.sha256(bytes.fromhex(state_key) + bytes.fromhex(digest)).hexdigest()
