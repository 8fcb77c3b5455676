"""verl-tool's tool-server protocol, as its trainers and servers speak it.

A trainer POSTs `{"trajectory_ids": [str], "actions": [str], "extra_fields"?: [object],
"finish"?: [bool], "is_last_step"?: [bool]}` (all lists of one length) to its
`tool_server_url` and reads `{"observations": [str | {"obs": str, ...}], "dones": [bool],
"valids": [bool]}`, plus `processing_time_ms` and `queue_time_ms` when the server gives them.
The server hands each tool the item's extra fields with `finish` and `is_last_step` added to
them (unless the extra fields have them already). A tool that fails answers, in a 200 response,
`{"obs": "", "error": "Tool processing failed: ..."}` with done true and valid false: the proxy
answers so for an upstream it cannot reach."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from core.errors import InvalidInput

log = logging.getLogger("tvcache.upstreams")

MAX_TRAJECTORY_ID = 200  # a rollout id
FLAGS = ("finish", "is_last_step")


@dataclass(frozen=True, slots=True)
class ActionItem:
    """One entry of a request, as the trainer sent it (None: the request had no such list)."""

    trajectory_id: str
    action: str
    extra_fields: dict | None
    finish: bool | None
    is_last_step: bool | None

    def tool_extra(self) -> dict:
        """The extra fields as the upstream's tool sees them."""
        extra = dict(self.extra_fields or {})
        for flag in FLAGS:
            value = getattr(self, flag)
            if value is not None and flag not in extra:
                extra[flag] = value
        return extra

    def to_json(self) -> dict:
        return {
            "trajectory_id": self.trajectory_id,
            "action": self.action,
            "extra_fields": self.extra_fields,
            "finish": self.finish,
            "is_last_step": self.is_last_step,
        }

    @classmethod
    def from_json(cls, data: dict) -> ActionItem:
        return cls(data["trajectory_id"], data["action"], data["extra_fields"], data["finish"], data["is_last_step"])


@dataclass(frozen=True, slots=True)
class Observation:
    observation: Any  # str, or an object with "obs"
    done: Any  # booleans, as the upstream wrote them
    valid: Any

    @property
    def tool_failed(self) -> bool:
        """verl-tool's answer for a tool that raised: the call may have run part way."""
        return not self.valid and isinstance(self.observation, dict) and "error" in self.observation

    def to_result(self) -> dict:
        return {"observation": self.observation, "done": self.done, "valid": self.valid}

    @classmethod
    def from_result(cls, result: dict) -> Observation:
        return cls(result["observation"], result["done"], result["valid"])


def failed(message: str) -> Observation:
    """What verl-tool's server answers for an action whose tool failed."""
    return Observation({"obs": "", "error": f"Tool processing failed: {message}"}, True, False)


def _list(payload: dict, field: str, length: int | None, check) -> list | None:
    value = payload.get(field)
    if value is None:
        return None
    if not isinstance(value, list) or (length is not None and len(value) != length):
        raise InvalidInput(
            f"'{field}' must be a list as long as 'trajectory_ids'.", code="invalid_payload", details={"field": field}
        )
    for index, item in enumerate(value):
        if not check(item):
            raise InvalidInput(
                f"'{field}[{index}]' has the wrong type.",
                code="invalid_payload",
                details={"field": f"{field}[{index}]"},
            )
    return value


def _trajectory_id(value) -> bool:
    return (isinstance(value, str) or isinstance(value, int) and not isinstance(value, bool)) and 0 < len(
        str(value)
    ) <= MAX_TRAJECTORY_ID


def request_parse(payload: Any) -> list[ActionItem]:
    """The items of a trainer's request. Fields other than the five are ignored, as verl-tool's
    server does."""
    if not isinstance(payload, dict):
        raise InvalidInput("The request body must be a JSON object.", code="invalid_payload")
    for field in ("trajectory_ids", "actions"):
        if not payload.get(field):
            raise InvalidInput(f"Missing or empty '{field}'.", code="missing_field", details={"field": field})
    ids = _list(payload, "trajectory_ids", None, _trajectory_id)
    actions = _list(payload, "actions", len(ids), lambda a: isinstance(a, str))
    extra = _list(payload, "extra_fields", len(ids), lambda e: e is None or isinstance(e, dict))
    flags = {flag: _list(payload, flag, len(ids), lambda f: isinstance(f, bool)) for flag in FLAGS}
    return [
        ActionItem(
            str(ids[i]),
            actions[i],
            extra[i] if extra is not None else None,
            *(flags[flag][i] if flags[flag] is not None else None for flag in FLAGS),
        )
        for i in range(len(ids))
    ]


def request_body(items: list[ActionItem]) -> dict:
    """The request that sends `items` to an upstream: the lists the trainer sent, and only those."""
    body: dict[str, Any] = {
        "trajectory_ids": [item.trajectory_id for item in items],
        "actions": [item.action for item in items],
    }
    if any(item.extra_fields is not None for item in items):
        body["extra_fields"] = [item.extra_fields or {} for item in items]
    for flag in FLAGS:
        if any(getattr(item, flag) is not None for item in items):
            body[flag] = [bool(getattr(item, flag)) for item in items]
    return body


def response_body(answers: list[Observation], *, processing_ms: float, queue_ms: float) -> dict:
    return {
        "observations": [a.observation for a in answers],
        "dones": [a.done for a in answers],
        "valids": [a.valid for a in answers],
        "processing_time_ms": processing_ms,
        "queue_time_ms": queue_ms,
    }


class UpstreamFailure(Exception):
    """The upstream did not answer a request: refused, timed out, an error status or a body that
    is not a verl-tool response."""


def _response_parse(body: bytes, length: int) -> list[Observation]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise UpstreamFailure(f"its answer is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UpstreamFailure("its answer is not a JSON object")
    columns = [data.get(key) for key in ("observations", "dones", "valids")]
    if not all(isinstance(column, list) and len(column) == length for column in columns):
        raise UpstreamFailure(f"its answer lacks observations, dones and valids for {length} actions")
    observations, dones, valids = columns
    if not all(isinstance(o, str) or isinstance(o, dict) and "obs" in o for o in observations):
        raise UpstreamFailure("an observation is neither a string nor an object with 'obs'")
    return [Observation(o, d, v) for o, d, v in zip(observations, dones, valids)]  # unchanged


_client_lock = threading.Lock()
_client: httpx.Client | None = None


def _http() -> httpx.Client:
    """One pooled client per process (httpx clients are thread-safe)."""
    global _client
    with _client_lock:
        if _client is None:
            _client = httpx.Client(limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        return _client


def upstream_post(*, url: str, items: list[ActionItem], timeout_s: float) -> tuple[list[Observation], float]:
    """The upstream's answers to `items`, sent in one request, and the time it took (ms)."""
    started = time.perf_counter()
    try:
        response = _http().post(
            url,
            content=orjson.dumps(request_body(items)),
            headers={"Content-Type": "application/json"},
            timeout=timeout_s,
        )
    except httpx.TimeoutException:
        raise UpstreamFailure(f"no answer within {timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise UpstreamFailure(f"{type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise UpstreamFailure(f"HTTP {response.status_code}: {response.text[:300]}")
    return _response_parse(response.content, len(items)), (time.perf_counter() - started) * 1000
