"""The JSON checks at the edge, once, for every app's request bodies: `load_json` (the hot front
doors), `load_body` (every cold endpoint's body, through DRF's parser: core.api.rendering) and the
typed checks each app's own body parsers are built from (`check_json`, `parse_int`, `parse_id`).

Each failure raises InvalidInput with a stable code and the offending field in `details`:
- `malformed_json`: not JSON (orjson refuses lone surrogates too: they answer `invalid_string`);
- `invalid_string`: a NUL character or a lone surrogate in a string, object key or id
  (PostgreSQL text and jsonb cannot hold NUL);
- `nesting_too_deep`: a value nested deeper than TVCACHE_MAX_JSON_DEPTH (64) arrays and objects;
- `invalid_payload`: a wrong type, or a number out of its column's range (`details`: field, min, max);
- `invalid_id`: an id longer than its column (task and rollout ids: 200).
"""

from __future__ import annotations

from typing import Any

import orjson
from django.conf import settings

from core.errors import InvalidInput

INT32 = (-(2**31), 2**31 - 1)  # an integer column (epoch)
INT64 = (-(2**63), 2**63 - 1)  # a bigint column (node ids, sizes)
MAX_ID_LENGTH = 200  # Task.id, Rollout.rollout_id, Node.tool
INVALID_STRING = "invalid_string"  # the code of a NUL or a lone surrogate
# A number that jsonb would give back as an integer beyond 64 bits (it prints 1e300 in full), which
# no JSON encoder here writes: args and envs hold numbers below it in magnitude.
_FLOAT_LIMIT = 2.0**63
# Levels of a request body around the values the depth limit applies to (body, history, call).
_ENVELOPE = 4


def depth_limit() -> int:
    return settings.TVCACHE.get("MAX_JSON_DEPTH", 64)


class _Fault(Exception):
    """What a JSON value holds that may not be stored: one of the codes below."""


_DEEP = "nesting_too_deep"
_NUMBER = "invalid_payload"
_MESSAGES = {
    INVALID_STRING: "'{field}' holds a NUL character (or a lone surrogate) in a string or key.",
    _DEEP: "'{field}' nests arrays and objects deeper than {limit} levels.",
    _NUMBER: "'{field}' holds a number beyond 64 bits (at most 2**63 in magnitude).",
}


def _walk(container: dict | list, depth: int, limit: int, strings: bool) -> None:
    # One pass over a parsed JSON container; hot (every call's args), hence the inlined checks.
    if depth > limit:
        raise _Fault(_DEEP)
    if type(container) is dict:
        if strings and "\x00" in "".join(container):
            raise _Fault(INVALID_STRING)
        items = container.values()
    else:
        items = container
    for item in items:
        kind = type(item)
        if kind is str:
            if strings and "\x00" in item:
                raise _Fault(INVALID_STRING)
        elif kind is dict or kind is list:
            _walk(item, depth + 1, limit, strings)
        elif kind is float and strings and not -_FLOAT_LIMIT < item < _FLOAT_LIMIT:
            raise _Fault(_NUMBER)


def check_json(value: Any, field: str, *, limit: int | None = None, storable: bool = True) -> None:
    """Refuse a parsed JSON value that cannot be stored: nested deeper than `limit` levels, or
    (`storable`, for what goes into jsonb and keys) holding NUL or a number jsonb would turn into an
    integer beyond 64 bits. Strings are never lone surrogates: orjson refuses them."""
    limit = depth_limit() if limit is None else limit
    try:
        if type(value) is dict or type(value) is list:
            _walk(value, 1, limit, storable)
        elif storable and type(value) is str and "\x00" in value:
            raise _Fault(INVALID_STRING)
    except _Fault as fault:
        code = fault.args[0]
        details = {"field": field, "limit": limit} if code == _DEEP else {"field": field}
        raise InvalidInput(_MESSAGES[code].format(field=field, limit=limit), code=code, details=details) from None


def load_json(body: bytes) -> Any:
    """The parsed body, or InvalidInput: `malformed_json`, `invalid_string` (a lone surrogate) or
    `nesting_too_deep` (orjson stops at 1,024 levels)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        message = str(exc)
        if "surrogate" in message:
            raise InvalidInput(f"A string holds a lone surrogate: {message}", code=INVALID_STRING) from None
        if "depth limit" in message:
            raise InvalidInput(
                f"The body nests too deep: {message}", code=_DEEP, details={"limit": depth_limit()}
            ) from None
        raise InvalidInput(f"Malformed JSON: {message}", code="malformed_json") from None


def load_body(body: bytes) -> Any:
    """A cold endpoint's body: parsed and checked whole (the values inside it, such as a task's
    env, get the depth limit; the request's own structure around them a few levels more)."""
    data = load_json(body)
    check_json(data, "body", limit=depth_limit() + _ENVELOPE)
    return data


def parse_int(value: Any, field: str, *, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise InvalidInput(
            f"'{field}' must be an integer from {low} to {high}.",
            code="invalid_payload",
            details={"field": field, "min": low, "max": high},
        )
    return value


def parse_query_int(params, field: str, default: int | None, *, low: int, high: int) -> int | None:
    """An integer query parameter (GET /tasks?offset=...), range-checked like a body's."""
    raw = params.get(field)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    return parse_int(value, field, low=low, high=high)


def parse_id(value: Any, field: str) -> str:
    """A task or rollout id: a string that fits its column (path or body)."""
    if not isinstance(value, str):
        raise InvalidInput(f"'{field}' must be a string.", code="invalid_payload", details={"field": field})
    if len(value) > MAX_ID_LENGTH:
        raise InvalidInput(
            f"'{field}' is longer than {MAX_ID_LENGTH} characters.",
            code="invalid_id",
            details={"field": field, "max_length": MAX_ID_LENGTH},
        )
    if "\x00" in value:
        raise InvalidInput(f"'{field}' holds a NUL character.", code=INVALID_STRING, details={"field": field})
    return value
