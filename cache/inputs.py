"""The bodies of the tool call graph's REST contract, parsed at the edge, once: plain checks, no
serializer overhead on the hot endpoints (lookup, record, tool-server calls). Each body parsed here
has one `parse_<body>` function, the endpoint's only validation; the serializers in
cache/api/serializers.py describe the same bodies for the OpenAPI schema, and a test checks each
against its parser (tests/cache/test_schema_inputs.py).

They are built on the JSON checks every app's bodies go through (core.inputs: its codes
`malformed_json`, `invalid_string`, `nesting_too_deep`, `invalid_payload`, `invalid_id`). Here a
tool name is an id too (`invalid_string` for a NUL in it), a call's args, a result and a task's
env get the depth limit (a result may hold NUL: it is stored as JSON text), and a node id out of
its column's range is `invalid_id`.
"""

from __future__ import annotations

from dataclasses import dataclass
from hashlib import sha256
from typing import Any

import orjson
from django.conf import settings

from cache.tcg import ToolCall
from cache.tcg.records import NO_TRACE, CallContext, CallRecord, Trace
from core.errors import InvalidInput, PayloadTooLarge
from core.inputs import INT32, INT64, INVALID_STRING, MAX_ID_LENGTH, check_json, depth_limit, parse_id, parse_int
from core.ttl import RecentMemo

# Histories this process parsed lately, by the digest of their JSON (history_digests): a rollout's
# next call sends its history again with one call more, which parse_call_context stored.
HISTORY_MEMO_ENTRIES = 8192
_parsed_histories: RecentMemo[bytes, tuple[ToolCall, ...]] = RecentMemo(HISTORY_MEMO_ENTRIES)

# Durations (exec_ms, create_ms, restore_ms) and snapshot sizes are added up in float8 and bigint
# columns and sums (path costs, time saved, a task's snapshot bytes), where PostgreSQL refuses an
# overflow: each is capped far above what a tool call or snapshot takes (116 days, 1 TiB).
MAX_MS = 1e10
MAX_SNAPSHOT_BYTES = 2**40
# A record's file times: at most this many entries and path characters, each path at most PATH_MAX
# characters. The one home of these limits: the service's own sandboxes keep as many of a call
# (sandboxes.handles passes them to the backends), and tvclient mirrors them.
MAX_FILE_TIMES = 20_000
MAX_FILE_TIMES_PATHS = 4 << 20
MAX_PATH_LENGTH = 4096


def parse_node_id(value: int) -> int:
    """A node id from a path (digits only): within its bigint column."""
    if not 1 <= value <= INT64[1]:
        raise InvalidInput(
            f"Node id {value} is out of range.",
            code="invalid_id",
            details={"field": "node_id", "min": 1, "max": INT64[1]},
        )
    return value


def _object(data: Any) -> dict:
    if not isinstance(data, dict):
        raise InvalidInput("The request body must be a JSON object.", code="invalid_payload")
    return data


def _required(data: dict, field: str) -> Any:
    if field not in data:
        raise InvalidInput(f"Missing field '{field}'.", code="missing_field", details={"field": field})
    return data[field]


def parse_call(value: Any, field: str, limit: int | None = None) -> ToolCall:
    if not isinstance(value, dict):
        raise InvalidInput(
            f"'{field}' must be an object {{tool, args}}.", code="invalid_call", details={"field": field}
        )
    tool, args = value.get("tool"), value.get("args", {})
    if not isinstance(tool, str) or not tool or len(tool) > MAX_ID_LENGTH:
        raise InvalidInput(
            f"'{field}.tool' must be a non-empty string of at most {MAX_ID_LENGTH} characters.",
            code="invalid_call",
            details={"field": f"{field}.tool"},
        )
    if not isinstance(args, dict):
        raise InvalidInput(
            f"'{field}.args' must be an object.", code="invalid_call", details={"field": f"{field}.args"}
        )
    if "\x00" in tool:
        raise InvalidInput(
            f"'{field}.tool' holds a NUL character.", code=INVALID_STRING, details={"field": f"{field}.tool"}
        )
    check_json(args, f"{field}.args", limit=limit)
    return ToolCall(tool, args)


def history_digests(history: Any, call: Any) -> tuple[bytes, bytes]:
    """sha256 of the history's JSON and of the JSON of the history after the call (the history
    with the call appended), or (b"", b"") when they do not serialize. The JSON is orjson's compact
    form of the parsed values: equal bytes are equal values, types included (1, 1.0 and true
    differ), so the memos these key never take one history for another. A client that sends
    the same calls with their keys in another order only misses the memos."""
    if not isinstance(history, list):
        return b"", b""
    try:
        listed, appended = orjson.dumps(history), orjson.dumps(call)
    except orjson.JSONEncodeError:
        return b"", b""
    after = (listed[:-1] + b"," if history else b"[") + appended + b"]"
    return sha256(listed).digest(), sha256(after).digest()


def parse_history(value: Any, field: str = "history", digest: bytes = b"") -> tuple[ToolCall, ...]:
    """The history's calls; with its `digest` (history_digests), from the memo if this process
    parsed it lately (a value that parsed once parses again the same)."""
    parsed = _parsed_histories.get(digest) if digest else None
    if parsed is not None:
        return parsed
    if not isinstance(value, list):
        raise InvalidInput(f"'{field}' must be a list of calls.", code="invalid_payload", details={"field": field})
    limit = settings.TVCACHE["MAX_HISTORY"]
    if len(value) > limit:
        raise PayloadTooLarge(
            f"'{field}' has {len(value)} calls; the limit is {limit}.",
            code="history_too_long",
            details={"limit": limit, "length": len(value)},
        )
    depth = depth_limit()
    parsed = tuple(parse_call(item, f"{field}[{index}]", depth) for index, item in enumerate(value))
    if digest:  # the same history again (another call after it, or the same lookup) parses no call
        _parsed_histories.put(digest, parsed)
    return parsed


def _optional(data: dict, field: str, kind: type, default: Any) -> Any:
    value = data.get(field)
    if value is None:
        return default
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise InvalidInput(f"'{field}' must be a {kind.__name__}.", code="invalid_payload", details={"field": field})
    return value


def parse_call_context(data: Any) -> CallContext:
    data = _object(data)
    items, call_item = _required(data, "history"), _required(data, "call")
    history_digest, next_digest = history_digests(items, call_item)
    # The same call after the same history parsed lately (another rollout's, or a lookup's
    # record): nothing of it is parsed again.
    parsed = _parsed_histories.get(next_digest) if next_digest else None
    if parsed is not None:
        history, call = parsed[:-1], parsed[-1]
    else:
        history = parse_history(items, digest=history_digest)
        call = parse_call(call_item, "call")
        if next_digest:
            _parsed_histories.put(next_digest, (*history, call))
    return CallContext(
        history=history,
        call=call,
        rollout_id=_rollout_id(data),
        epoch=parse_epoch(data),
        env_fingerprint=_optional(data, "env_fingerprint", str, None),
        trace=parse_trace(data),
        history_digest=history_digest,
        next_digest=next_digest,
    )


# An opaque trajectory reference, as long as a trainer's ids reasonably get.
MAX_TRAJECTORY_REF = 1000
TOKEN_SPANS = ("prompt", "completion")
_TRACE_FIELDS = frozenset(("trajectory_ref", "tokens", "seq", "branch_of"))


def parse_trace(data: dict, *, spans: tuple[str, ...] = TOKEN_SPANS) -> Trace:
    """A body's optional tree-export fields (cache.tcg.records.Trace): `trajectory_ref`, `tokens`,
    `seq` and `branch_of` ({"rollout": R, "step": k, "tokens": {"prompt": [0, n]}})."""
    if _TRACE_FIELDS.isdisjoint(data):
        return NO_TRACE
    ref = _optional(data, "trajectory_ref", str, "")
    if len(ref) > MAX_TRAJECTORY_REF or "\x00" in ref:
        raise InvalidInput(
            f"'trajectory_ref' must be at most {MAX_TRAJECTORY_REF} characters, without NUL.",
            code="invalid_payload",
            details={"field": "trajectory_ref", "max": MAX_TRAJECTORY_REF},
        )
    seq = data.get("seq")
    branch_of = data.get("branch_of")
    if branch_of is not None:
        if not isinstance(branch_of, dict) or not {"rollout", "step"} <= set(branch_of) <= {
            "rollout",
            "step",
            "tokens",
        }:
            raise InvalidInput(
                '\'branch_of\' must be {"rollout": <id>, "step": <k>, "tokens": {"prompt": [start, end]}}.',
                code="invalid_payload",
                details={"field": "branch_of"},
            )
        branch_of = (
            parse_id(branch_of["rollout"], "branch_of.rollout"),
            parse_int(branch_of["step"], "branch_of.step", low=0, high=INT32[1]),
            parse_tokens(branch_of.get("tokens"), "branch_of.tokens", ("prompt",)),
        )
    return Trace(
        ref=ref,
        tokens=parse_tokens(data.get("tokens"), "tokens", spans),
        seq=None if seq is None else parse_int(seq, "seq", low=0, high=INT32[1]),
        branch_of=branch_of,
    )


def parse_tokens(value: Any, field: str, spans: tuple[str, ...] = TOKEN_SPANS) -> dict[str, tuple[int, int]] | None:
    """Token spans, e.g. {"prompt": [0, 120], "completion": [120, 180]}: half-open [start, end)
    offsets into the trajectory's tokens, each span optional."""
    if value is None:
        return None
    if not isinstance(value, dict) or not set(value) <= set(spans):
        raise InvalidInput(
            f"'{field}' must be an object with {' and/or '.join(repr(s) for s in spans)}: [start, end].",
            code="invalid_payload",
            details={"field": field},
        )
    found = {}
    for name in spans:
        span = value.get(name)
        if span is None:
            continue
        if not (isinstance(span, list) and len(span) == 2):
            raise InvalidInput(
                f"'{field}.{name}' must be [start, end].", code="invalid_payload", details={"field": f"{field}.{name}"}
            )
        start = parse_int(span[0], f"{field}.{name}", low=0, high=INT32[1])
        end = parse_int(span[1], f"{field}.{name}", low=start, high=INT32[1])
        found[name] = (start, end)
    return found


def _rollout_id(data: dict) -> str:
    value = data.get("rollout_id")
    return "" if value is None else parse_id(value, "rollout_id")


def parse_epoch(data: dict) -> int:
    """A body's "epoch" (default 0): an integer column."""
    epoch = data.get("epoch")
    return 0 if epoch is None else parse_int(epoch, "epoch", low=INT32[0], high=INT32[1])


@dataclass(frozen=True, slots=True)
class LookupInput:
    context: CallContext
    claim: bool  # client-mode single flight: a miss takes the call's claim (held by a rollout)
    resume: bool  # False: the caller's sandbox already follows the history, a miss leases no snapshot


def parse_lookup(data: Any) -> LookupInput:
    context = parse_call_context(data)
    claim = _optional(data, "claim", bool, False)
    if claim and not context.rollout_id:
        raise InvalidInput(
            "'claim' needs a 'rollout_id': a claim is held by a rollout.",
            code="missing_field",
            details={"field": "rollout_id"},
        )
    return LookupInput(context=context, claim=claim, resume=_optional(data, "resume", bool, True))


def parse_claim_release(data: Any) -> CallContext:
    """The call whose claim its rollout gives up."""
    context = parse_call_context(data)
    if not context.rollout_id:
        raise InvalidInput(
            "'rollout_id' is required: a claim is held by a rollout.",
            code="missing_field",
            details={"field": "rollout_id"},
        )
    return context


@dataclass(frozen=True, slots=True)
class RolloutCallInput:
    call: ToolCall
    epoch: int
    trace: Trace


def parse_rollout_call(data: Any) -> RolloutCallInput:
    """A tool-server call: the rollout's next call (its history is the service's)."""
    data = _object(data)
    return RolloutCallInput(
        call=parse_call(_required(data, "call"), "call"), epoch=parse_epoch(data), trace=parse_trace(data)
    )


# Branches one request may open (each may take a sandbox).
MAX_BRANCHES = 64


@dataclass(frozen=True, slots=True)
class BranchInput:
    """Where branches start: after `step` calls of rollout `rollout` (its history's state-changing
    calls), or at node `node_id`; how many, with which new rollout ids (None: made up)."""

    rollout: str | None
    step: int | None
    node_id: int | None
    rollout_ids: tuple[str, ...] | None
    count: int
    epoch: int
    tokens: dict[str, tuple[int, int]] | None = (
        None  # {"prompt": [0, n]}: what each branch shares of its origin's tokens
    )
    trajectory_refs: tuple[str, ...] | None = None  # one per branch


def parse_branch(data: Any) -> BranchInput:
    """A branch request: `{"from": {"rollout": R, "step": k} | {"node_id": N}, "count": n,
    "rollout_ids": [...], "epoch": e, "tokens": {"prompt": [0, n]}, "trajectory_refs": [...]}`;
    `rollout_ids` and `trajectory_refs` (optional) have `count` items, the ids distinct."""
    data = _object(data)
    origin = _required(data, "from")
    if not isinstance(origin, dict) or not (set(origin) == {"rollout", "step"} or set(origin) == {"node_id"}):
        raise InvalidInput(
            '\'from\' must be {"rollout": <id>, "step": <k>} or {"node_id": <id>}.',
            code="invalid_payload",
            details={"field": "from"},
        )
    rollout = step = node_id = None
    if "node_id" in origin:
        node_id = parse_int(origin["node_id"], "from.node_id", low=1, high=INT64[1])
    else:
        rollout = parse_id(origin["rollout"], "from.rollout")
        step = parse_int(origin["step"], "from.step", low=0, high=INT32[1])
    ids = data.get("rollout_ids")
    count = data.get("count", len(ids) if isinstance(ids, list) else None)
    if count is None:
        raise InvalidInput("Missing field 'count'.", code="missing_field", details={"field": "count"})
    count = parse_int(count, "count", low=1, high=MAX_BRANCHES)
    if ids is not None:
        if not isinstance(ids, list) or len(ids) != count:
            raise InvalidInput(
                f"'rollout_ids' must be a list of {count} rollout ids.",
                code="invalid_payload",
                details={"field": "rollout_ids"},
            )
        ids = tuple(parse_id(value, "rollout_ids") for value in ids)
        if len(set(ids)) != len(ids):
            raise InvalidInput("'rollout_ids' repeats an id.", code="invalid_payload", details={"field": "rollout_ids"})
    refs = data.get("trajectory_refs")
    if refs is not None:
        if not isinstance(refs, list) or len(refs) != count:
            raise InvalidInput(
                f"'trajectory_refs' must be a list of {count} strings.",
                code="invalid_payload",
                details={"field": "trajectory_refs"},
            )
        refs = tuple(parse_trace({"trajectory_ref": ref}).ref for ref in refs)
    tokens = parse_tokens(data.get("tokens"), "tokens", ("prompt",))
    return BranchInput(rollout, step, node_id, ids, count, parse_epoch(data), tokens, refs)


@dataclass(frozen=True, slots=True)
class TaskInput:
    env: dict
    tools: dict[str, dict[str, bool]]  # tool name -> {"mutates_state", "cacheable"}
    sandbox_budget: int | None  # None: the service's default for a new task, the task's own for an update
    audit_rate: float | None  # None: the service's default
    match: str | None  # "history" or "state"; None: the task's (a new task: the service's default)
    # Retention bounds the body names (max_nodes, max_result_bytes): a number, or None for the
    # project's default. One it leaves out keeps the task's (a new task: the project's default).
    retention: dict[str, int | None]


RETENTION_BOUNDS = {"max_nodes": INT32[1], "max_result_bytes": INT64[1]}


def parse_task(data: Any) -> TaskInput:
    """A task's PUT body. Strings, keys and nesting were checked with the whole body (load_body)."""
    data = _object(data)
    env = _required(data, "env")
    sandbox_budget = data.get("sandbox_budget")
    if sandbox_budget is not None:
        parse_int(sandbox_budget, "sandbox_budget", low=0, high=INT32[1])
    if not isinstance(env, dict):
        raise InvalidInput("'env' must be an object.", code="invalid_payload", details={"field": "env"})
    return TaskInput(
        env=env,
        tools=_tools(data.get("tools")),
        sandbox_budget=sandbox_budget,
        audit_rate=_audit_rate(data.get("audit_rate")),
        match=_match(data.get("match")),
        retention={
            name: None if data[name] is None else parse_int(data[name], name, low=0, high=high)
            for name, high in RETENTION_BOUNDS.items()
            if name in data
        },
    )


def _tools(tools: Any) -> dict[str, dict[str, bool]]:
    """Each tool's policy, with the flags it leaves out set to true (the safe default)."""
    if tools is None:
        return {}
    if not isinstance(tools, dict):
        raise InvalidInput(
            "'tools' must be an object of tool policies.", code="invalid_payload", details={"field": "tools"}
        )
    clean = {}
    for name, spec in tools.items():
        if not isinstance(spec, dict) or set(spec) - {"mutates_state", "cacheable"}:
            raise InvalidInput(
                f"Tool '{name}' must be {{mutates_state, cacheable}}.",
                code="invalid_payload",
                details={"field": f"tools.{name}"},
            )
        if any(not isinstance(value, bool) for value in spec.values()):
            raise InvalidInput(
                f"Tool '{name}' flags must be booleans.", code="invalid_payload", details={"field": f"tools.{name}"}
            )
        clean[name] = {"mutates_state": spec.get("mutates_state", True), "cacheable": spec.get("cacheable", True)}
    return clean


def _match(match: Any) -> str | None:
    if match is None or match in ("history", "state"):
        return match
    raise InvalidInput('\'match\' must be "history" or "state".', code="invalid_payload", details={"field": "match"})


def _audit_rate(audit_rate: Any) -> float | None:
    if audit_rate is None:
        return None
    if isinstance(audit_rate, bool) or not isinstance(audit_rate, (int, float)) or not 0.0 <= audit_rate <= 1.0:
        raise InvalidInput(
            "'audit_rate' must be a number from 0 to 1.", code="invalid_payload", details={"field": "audit_rate"}
        )
    return float(audit_rate)


def parse_record(data: Any) -> CallRecord:
    context = parse_call_context(data)
    result = _required(data, "result")
    check_json(result, "result", storable=False)  # stored as JSON text, where NUL is escaped
    exec_ms = _required(data, "exec_ms")
    if not isinstance(exec_ms, (int, float)) or isinstance(exec_ms, bool) or not 0 <= exec_ms <= MAX_MS:
        raise InvalidInput(
            f"'exec_ms' must be a number from 0 to {MAX_MS:.0f}.",
            code="invalid_payload",
            details={"field": "exec_ms", "min": 0, "max": MAX_MS},
        )
    mutated = _optional(data, "mutated", bool, None)
    return CallRecord(
        context=context,
        result=result,
        exec_ms=float(exec_ms),
        mutated=mutated,
        file_times=parse_file_times(data.get("file_times")),
        replay=_optional(data, "replay", bool, False),
    )


def parse_file_times(value: Any) -> dict[str, int] | None:
    """A record's `file_times`: {path: modification time in ns}, at most MAX_FILE_TIMES entries and
    MAX_FILE_TIMES_PATHS characters of paths; `invalid_payload` (or `invalid_string` for a NUL in a
    path) otherwise."""
    if value is None:
        return None
    if type(value) is not dict:
        raise InvalidInput(
            "'file_times' must be an object {path: nanoseconds}.",
            code="invalid_payload",
            details={"field": "file_times"},
        )
    if len(value) > MAX_FILE_TIMES:
        raise InvalidInput(
            f"'file_times' has {len(value)} entries; at most {MAX_FILE_TIMES}.",
            code="invalid_payload",
            details={"field": "file_times", "max_entries": MAX_FILE_TIMES},
        )
    for path, mtime_ns in value.items():
        if not path or len(path) > MAX_PATH_LENGTH:
            raise InvalidInput(
                f"'file_times' paths must be 1 to {MAX_PATH_LENGTH} characters long.",
                code="invalid_payload",
                details={"field": "file_times", "max_length": MAX_PATH_LENGTH},
            )
        if "\x00" in path:
            raise InvalidInput(
                "A 'file_times' path holds a NUL character.", code=INVALID_STRING, details={"field": "file_times"}
            )
        parse_int(mtime_ns, f"file_times[{path[:100]!r}]", low=0, high=INT64[1])
    if sum(map(len, value)) > MAX_FILE_TIMES_PATHS:
        raise InvalidInput(
            f"'file_times' paths add up to more than {MAX_FILE_TIMES_PATHS} characters.",
            code="invalid_payload",
            details={"field": "file_times", "max_total": MAX_FILE_TIMES_PATHS},
        )
    return value


@dataclass(frozen=True, slots=True)
class FileTimesQuery:
    context: CallContext  # the history and the call the replay leads up to
    replay: tuple[ToolCall, ...]  # the last state-changing calls of the history, replayed


def parse_file_times_query(data: Any) -> FileTimesQuery:
    """A client's replay: the file times to write back after each of its calls."""
    data = _object(data)
    history = parse_history(_required(data, "history"))
    call = parse_call(_required(data, "call"), "call")
    replay = parse_history(_required(data, "replay"), "replay")
    return FileTimesQuery(context=CallContext(history, call, "", 0, None), replay=replay)
