"""What a replay measures: a sample per call and per rollout, gathered per epoch and arm."""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass, field
from typing import Any

from .faults import timed_out


def digest(result: Any) -> str:
    return hashlib.sha256(json.dumps(result, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


@dataclass
class CallSample:
    task: str
    epoch: int
    rollout: int
    position: int
    tool: str
    latency_ms: float
    cached: bool | None  # None in the nocache arm
    env_ms: float | None  # time inside local sandboxes during the call (nocache, client)
    result_digest: str
    lookup_ms: float | None = None  # client mode: the lookup request
    lookup_server_ms: float | None = None  # client mode: the service's own time on it (Server-Timing)
    # client mode: time the call waited for the previous miss's background work (record, snapshot)
    background_wait_ms: float | None = None
    result: Any = None  # kept only until compared
    started: float = 0.0  # perf_counter when the call was sent (last sent, if it was sent again)
    key: tuple[str, str] | None = None  # (anchor state key, call digest); None for a tool that is not cacheable
    mutates: bool | None = None  # whether the call changed the state, as the service or executor tells
    # Under faults (faults.py):
    fault: str | None = None  # the fault that hit this call (sandbox_death: its container died just before)
    injected: bool = False  # its answer is an injected fault's, not the tool's: not compared
    failed: bool = False  # it got no answer (the service failed, also when sent again): not compared
    retries: int = 0  # times it was sent again because the service did not answer
    answer_timed_out: bool = False  # its answer says timed out (a hit too: the cache kept a timed-out answer)
    event: bool = False  # it left its rollout's state unknown (mark_unknown_state): its answer is not to share
    unshared: bool = False  # it comes after such an event of its rollout: off the shared graph
    step: str | None = None  # the workload's label of the call (Workload.steps), e.g. VERIFY_STEP
    # tool-server mode, a miss: where the service spent its time, by phase (CallResult.phases_ms)
    phases_ms: dict[str, float] | None = None


def mark_unknown_state(samples: list[CallSample]) -> None:
    """The known-state rule on one rollout's samples, in order: a call that ran and timed out, an
    injected environment fault and a call left without an answer leave the state unknown; the
    rollout's calls from there are off the shared graph. A sandbox death between two calls does
    not: no call was running, the service retires the dead sandbox and the rollout goes on from
    its history (which the wrong-answer counts check). A hit that answers timed out ran nothing:
    it is a wrong answer (counted), not an event."""
    unknown = False
    for sample in samples:
        sample.unshared = unknown
        sample.answer_timed_out = timed_out(sample.result)
        sample.event = sample.injected or sample.failed or (sample.answer_timed_out and not sample.cached)
        unknown = unknown or sample.event


@dataclass
class RolloutSample:
    task: str
    rollout: int
    seconds: float
    calls: int


@dataclass
class EpochRun:
    arm: str
    epoch: int
    calls: list[CallSample] = field(default_factory=list)
    rollouts: list[RolloutSample] = field(default_factory=list)
    step_s: float = 0.0
    warm_wait_s: float = 0.0
    sandboxes: dict[str, float] = field(default_factory=dict)
    service: dict[str, Any] = field(default_factory=dict)
    exact: dict[str, Any] = field(default_factory=dict)
