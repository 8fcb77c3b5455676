"""Input parsing for the hot endpoints (lookup, record): plain checks, no serializer overhead.

Each failure raises InvalidInput with a stable code and the offending field in `details`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings

from cache.errors import InvalidInput, PayloadTooLarge
from cache.tcg import ToolCall


@dataclass(frozen=True, slots=True)
class CallContext:
    history: tuple[ToolCall, ...]
    call: ToolCall
    rollout_id: str
    epoch: int
    env_fingerprint: str | None


def _object(data: Any) -> dict:
    if not isinstance(data, dict):
        raise InvalidInput("The request body must be a JSON object.", code="invalid_payload")
    return data


def _required(data: dict, field: str) -> Any:
    if field not in data:
        raise InvalidInput(f"Missing field '{field}'.", code="missing_field", details={"field": field})
    return data[field]


def parse_call(value: Any, field: str) -> ToolCall:
    if not isinstance(value, dict):
        raise InvalidInput(f"'{field}' must be an object {{tool, args}}.", code="invalid_call", details={"field": field})
    tool, args = value.get("tool"), value.get("args", {})
    if not isinstance(tool, str) or not tool or len(tool) > 200:
        raise InvalidInput(f"'{field}.tool' must be a non-empty string.", code="invalid_call", details={"field": f"{field}.tool"})
    if not isinstance(args, dict):
        raise InvalidInput(f"'{field}.args' must be an object.", code="invalid_call", details={"field": f"{field}.args"})
    return ToolCall(tool, args)


def parse_history(value: Any) -> tuple[ToolCall, ...]:
    if not isinstance(value, list):
        raise InvalidInput("'history' must be a list of calls.", code="invalid_payload", details={"field": "history"})
    limit = settings.TVCACHE["MAX_HISTORY"]
    if len(value) > limit:
        raise PayloadTooLarge(f"History has {len(value)} calls; the limit is {limit}.", code="history_too_long",
                              details={"limit": limit, "length": len(value)})
    return tuple(parse_call(item, f"history[{index}]") for index, item in enumerate(value))


def _optional(data: dict, field: str, kind: type, default: Any) -> Any:
    value = data.get(field)
    if value is None:
        return default
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise InvalidInput(f"'{field}' must be a {kind.__name__}.", code="invalid_payload", details={"field": field})
    return value


def parse_call_context(data: Any) -> CallContext:
    data = _object(data)
    history = parse_history(_required(data, "history"))
    call = parse_call(_required(data, "call"), "call")
    return CallContext(
        history=history,
        call=call,
        rollout_id=_optional(data, "rollout_id", str, "")[:200],
        epoch=_optional(data, "epoch", int, 0),
        env_fingerprint=_optional(data, "env_fingerprint", str, None),
    )


def parse_claim(data: dict, context: CallContext) -> bool:
    """A lookup's "claim" flag (client-mode single flight); a claim is held by a rollout."""
    claim = _optional(data, "claim", bool, False)
    if claim and not context.rollout_id:
        raise InvalidInput("'claim' needs a 'rollout_id': a claim is held by a rollout.", code="missing_field",
                           details={"field": "rollout_id"})
    return claim


def parse_resume(data: dict) -> bool:
    """A lookup's "resume" flag: False when the caller's sandbox already follows the history,
    so that a miss leases no snapshot it would not fork."""
    return _optional(data, "resume", bool, True)


@dataclass(frozen=True, slots=True)
class RecordInput:
    context: CallContext
    result: Any
    exec_ms: float
    # Whether the call changed the sandbox, as the executor observed it; None: not observed. Only
    # False matters: the call then counts as read-only, whatever its tool declares.
    mutated: bool | None = None


def parse_record(data: Any) -> RecordInput:
    context = parse_call_context(data)
    result = _required(data, "result")
    exec_ms = _required(data, "exec_ms")
    if not isinstance(exec_ms, (int, float)) or isinstance(exec_ms, bool) or exec_ms < 0:
        raise InvalidInput("'exec_ms' must be a non-negative number.", code="invalid_payload", details={"field": "exec_ms"})
    mutated = _optional(data, "mutated", bool, None)
    return RecordInput(context=context, result=result, exec_ms=float(exec_ms), mutated=mutated)
