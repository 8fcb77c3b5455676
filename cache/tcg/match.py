"""State chains and longest-prefix match (LPM) over them.

A history h_1..h_n yields a chain of state keys: the root key, then one new key after each
state-changing call. Read-only calls leave the key as it is, so their order between two writes
does not matter. Each stored node sits under (anchor state key, digest of its call); a
state-changing node also names the state key it leads to. LPM asks the store which of the
chain's state keys exist (one query) and picks, here, the deepest one, the deepest one with a
live snapshot that can stand in for its state, and the state-changing calls to replay from that
snapshot. A snapshot of a state with live processes stands in for it only if it keeps them (a
checkpoint): a copy of the files alone would bring the state up without its servers and daemons,
and replaying from it would not start them again (docs/design/state.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .keys import ToolCall, call_digest, next_state_key, root_state_key
from .policy import TaskPolicy


@dataclass(frozen=True, slots=True)
class ChainStep:
    position: int  # index of the call in the history (the looked-up call is position n)
    call: ToolCall
    digest: str
    anchor: str  # state key before the call
    state_key: str  # state key after the call (== anchor for a read-only call)
    mutates: bool


@dataclass(frozen=True, slots=True)
class StateChain:
    root: str
    steps: tuple[ChainStep, ...]

    @property
    def final(self) -> str:
        return self.steps[-1].state_key if self.steps else self.root

    @property
    def writes(self) -> tuple[ChainStep, ...]:
        return tuple(step for step in self.steps if step.mutates)


@dataclass(frozen=True, slots=True)
class RecordPlan:
    """Where a recorded call's node goes: under (anchor, digest), leading to `state_key`."""

    anchor: str  # state before the call; also the key of its parent (the last state-changing node)
    digest: str
    state_key: str  # state after the call: the anchor's when it is stored read-only
    depth: int  # the history's state-changing calls, plus one for the call itself
    mutates: bool


def record_plan(chain: StateChain, policy: TaskPolicy, mutated: bool | None) -> RecordPlan:
    """The node a call at the end of `chain` is recorded as. `mutated=False`: its sandbox saw it
    change nothing, so it is stored read-only whatever its tool declares (the state after it is
    the state before it, and later calls hang where they would without it)."""
    last = chain.steps[-1]
    mutates = policy.for_tool(last.call.tool).changes_state(mutated)
    return RecordPlan(
        anchor=last.anchor,
        digest=last.digest,
        state_key=last.state_key if mutates else last.anchor,
        depth=len(chain.writes) + (0 if last.mutates else 1),
        mutates=mutates,
    )


def state_chain(fingerprint: str, calls: Iterable[ToolCall], policy: TaskPolicy) -> StateChain:
    state = root = root_state_key(fingerprint)
    steps = []
    for position, call in enumerate(calls):
        steps.append(_step(position, call, state, policy))
        state = steps[-1].state_key
    return StateChain(root=root, steps=tuple(steps))


def chain_extended(chain: StateChain, call: ToolCall, policy: TaskPolicy) -> StateChain:
    """`chain` with one call more: state_chain(f, [*calls, call], p) from state_chain(f, calls, p)."""
    return StateChain(root=chain.root, steps=(*chain.steps, _step(len(chain.steps), call, chain.final, policy)))


def _step(position: int, call: ToolCall, state: str, policy: TaskPolicy) -> ChainStep:
    digest = call_digest(call)
    mutates = policy.for_tool(call.tool).mutates_state
    return ChainStep(position, call, digest, state, next_state_key(state, digest) if mutates else state, mutates)


@dataclass(frozen=True, slots=True)
class NodeRef:
    """What the store knows about the state-changing node that leads to `state_key`."""

    node_id: int
    state_key: str
    depth: int
    cum_exec_ms: float = 0.0
    snapshot_id: int | None = None
    snapshot_ref: str | None = None
    processes: int = 0  # the processes the state keeps running (Node.live_processes)
    snapshot_keeps_processes: bool = False  # its snapshot holds them (a checkpoint)

    @property
    def resumable(self) -> bool:
        """It has a snapshot that can stand in for its state."""
        return self.snapshot_id is not None and (not self.processes or self.snapshot_keeps_processes)


@dataclass(frozen=True, slots=True)
class Match:
    matched: int  # leading history calls whose state the deepest matched node holds
    node: NodeRef | None  # deepest matched state-changing node; None = the root
    resume: NodeRef | None  # deepest matched node with a live snapshot; None = a fresh sandbox
    replay: tuple[ToolCall, ...]  # state-changing calls to replay on top of `resume`


def longest_prefix_match(chain: StateChain, found: Mapping[str, NodeRef]) -> Match:
    """`chain` is the history's chain; `found` maps the chain's state keys that exist to nodes."""
    writes = chain.writes
    deepest = 0  # number of writes whose resulting state is held by a stored node
    for index in range(len(writes), 0, -1):
        if writes[index - 1].state_key in found:
            deepest = index
            break
    resume_index = 0
    for index in range(deepest, 0, -1):
        ref = found.get(writes[index - 1].state_key)
        if ref is not None and ref.resumable:
            resume_index = index
            break
    matched = writes[deepest].position if deepest < len(writes) else len(chain.steps)
    node = found[writes[deepest - 1].state_key] if deepest else None
    resume = found[writes[resume_index - 1].state_key] if resume_index else None
    replay = tuple(step.call for step in writes[resume_index:])
    return Match(matched=matched, node=node, resume=resume, replay=replay)


@dataclass(frozen=True, slots=True)
class CatchUp:
    """How a sandbox that holds an earlier state of the chain catches up (`catch_up`)."""

    replay_ms: float  # replaying the writes it lacks, by the calls' recorded times
    fork: Match | None  # cheaper: restore `fork.resume` (a snapshot past its state), replay `fork.replay`


def catch_up(chain: StateChain, found: Mapping[str, NodeRef], applied: int, restore_ms: float) -> CatchUp | None:
    """A sandbox holds the state after the first `applied` steps of `chain` (`found` maps the
    chain's state keys that exist to their nodes). It replays the writes it lacks, unless restoring
    the deepest snapshot past its state (`restore_ms`) and replaying what follows that costs less.
    None when a write's node is missing (its time is unknown) or nothing is lacking."""
    writes = chain.writes
    done = sum(1 for step in chain.steps[:applied] if step.mutates)
    if done >= len(writes) or any(step.state_key not in found for step in writes):
        return None
    last = found[writes[-1].state_key].cum_exec_ms
    replay_ms = last - (found[writes[done - 1].state_key].cum_exec_ms if done else 0.0)
    match = longest_prefix_match(chain, found)
    resume = match.resume
    if resume is None or resume.depth <= done:  # (a state-changing node's depth: the writes up to its state)
        return CatchUp(replay_ms, None)
    return CatchUp(replay_ms, match if restore_ms + last - resume.cum_exec_ms < replay_ms else None)
