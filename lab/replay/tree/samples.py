"""What a tree replay measures beyond a flat replay's call samples: each branch point's request,
each branch's readiness, and each arm's sandbox-seconds, per epoch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..samples import CallSample
from .plan import Trajectory


@dataclass
class Opened:
    """A branch as its origin handed it over: where it starts and, where the arm makes it at the
    request (server, client), when it was ready."""

    origin: str  # the origin trajectory's id
    prefix_calls: int  # calls of the history before the branch point
    step: int | None  # the origin's state-changing calls there, as the arm counts them (None: nocache)
    ready_ms: float | None = None  # nocache: set by the branch itself (a fresh sandbox, the prefix replayed)
    service_ready_ms: float | None = None  # server: the branch's `ready_ms` as the service answered it
    materialized: str = ""  # server: how its sandbox got to the state
    handle: Any = None  # client: the branch's executor; server: the history the service answered


@dataclass
class BranchRequest:
    """One branch point of one arm: server, POST .../branches; client, ToolCallExecutor.branch;
    nocache, none (each branch makes its own sandbox)."""

    task: str
    epoch: int
    origin: str
    prefix_calls: int
    step: int | None
    count: int
    request_ms: float | None = None
    node_id: int | None = None
    # server: the answer's `history` differs from the origin's state-changing calls up to the point
    history_mismatch: dict[str, Any] | None = None
    error: dict[str, Any] | None = None  # the request failed: what was sent, what came back


@dataclass
class BranchReady:
    """One branch of one arm: until its first call could run, and that call."""

    task: str
    epoch: int
    trajectory: str
    origin: str
    prefix_calls: int
    step: int | None
    ready_ms: float
    first_call_ms: float
    first_call_cached: bool | None
    service_ready_ms: float | None = None
    materialized: str = ""
    misses: int = 0  # of its own calls: 0, its calls all hit (a sandbox made for it ran none of them)


@dataclass
class TrajectoryRun:
    trajectory: Trajectory
    samples: list[CallSample]
    seconds: float
    requests: list[BranchRequest] = field(default_factory=list)
    ready: BranchReady | None = None
    # per call: whether it ran in a sandbox the trajectory already held, as one execution (None: unknown)
    held: list[bool | None] = field(default_factory=list)


@dataclass
class TreeRun:
    """One arm's epoch of trees, beside its EpochRun."""

    arm: str
    epoch: int
    requests: list[BranchRequest] = field(default_factory=list)
    branches: list[BranchReady] = field(default_factory=list)
    trajectories: int = 0
    levels: dict[int, int] = field(default_factory=dict)  # trajectories per level
    sandbox_s: float = 0.0
    sandboxes: int = 0  # local sandboxes whose lifetimes were summed (nocache, client)
    sandbox_s_measured: str = ""  # "lifetimes" or "sampled"
    sandbox_s_by_state: dict[str, float] = field(default_factory=dict)  # sampled: by "<state>/<pool>"
    wall_s: float = 0.0
    held_ms: list[float] = field(default_factory=list)  # latencies of calls that ran in a sandbox already held
