"""A call in its rollout's context, the record of what it returned, and the state it left in the
service's own sandbox: the domain's types that the REST edge (cache/inputs.py), tool-server mode and
the proxy build and the services take."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .keys import ToolCall


@dataclass(frozen=True, slots=True)
class Trace:
    """What a trainer tells about a call for the rollout tree export (docs/design/tree-search.md):
    the trajectory it belongs to (`ref`, opaque), the call's token spans in it (`tokens`:
    {"prompt": [start, end], "completion": [start, end]}), its position among the rollout's calls
    (`seq`: orders calls whose records come late, as tvclient's background ones do), and for the
    first calls of a client-mode branch where it started (`branch_of`: rollout, step, and its
    shared token span). Nothing here changes what a lookup answers."""

    ref: str = ""
    tokens: Mapping[str, tuple[int, int]] | None = None
    seq: int | None = None
    branch_of: tuple[str, int, Mapping[str, tuple[int, int]] | None] | None = None


NO_TRACE = Trace()


@dataclass(frozen=True, slots=True)
class CallContext:
    """A call after the rollout's history of state-changing calls, checked against the env's
    fingerprint when the caller sent one."""

    history: tuple[ToolCall, ...]
    call: ToolCall
    rollout_id: str
    epoch: int
    env_fingerprint: str | None
    trace: Trace = NO_TRACE
    # sha256 of the history's JSON as the client sent it, and of the history the rollout's next
    # call sends when this call is part of it (b"": not known). Keys of the process's memos of
    # parsed histories and of their state chains: a rollout's next call then costs no work per
    # call of its history (cache.inputs.history_digests).
    history_digest: bytes = b""
    next_digest: bytes = b""


@dataclass(frozen=True, slots=True)
class CallRecord:
    """What a call returned, to be filed under its context's state."""

    context: CallContext
    result: Any
    exec_ms: float
    # Whether the call changed the sandbox, as the executor observed it; None: not observed. Only
    # False matters: the call then counts as read-only, whatever its tool declares.
    mutated: bool | None = None
    # The modification times (ns, by path) of what the call changed in the client's sandbox: what
    # a replay of the call there writes back (Node.file_times). None: not kept (a replay then
    # restores no time from this call on); {}: the call changed no entry's time.
    file_times: dict[str, int] | None = None
    # The call ran again only to rebuild the sandbox's state (a replay): its time was not saved.
    replay: bool = False


@dataclass(frozen=True, slots=True)
class RecordedState:
    """What a node keeps of the sandbox after its call (docs/design/state.md):
    - `full`, `shape`, `order`: the state fingerprint's digests, which a sandbox materialized for the
      node is checked against ("" where the call ran elsewhere: client mode);
    - `file_times`: the modification times of what the call changed, written back after each
      replay of it (None: not kept);
    - `processes`: how many processes the sandbox kept running after it."""

    full: str = ""
    shape: str = ""
    order: str = ""
    file_times: Mapping[str, int] | None = None
    processes: int = 0
