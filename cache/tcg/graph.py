"""An in-memory tool call graph: the reference implementation of lookup and record.

The service stores the same nodes in PostgreSQL; this class is what the property tests check
the algorithm against, and a model of what the store must answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .keys import ToolCall
from .match import Match, NodeRef, StateChain, longest_prefix_match, record_plan, state_chain
from .policy import TaskPolicy


@dataclass(frozen=True, slots=True)
class Hit:
    node_id: int
    result: Any
    mutates: bool


@dataclass
class _Node:
    node_id: int
    state_key: str
    depth: int
    result: Any
    mutates: bool
    snapshot_id: int | None = None


class ToolCallGraph:
    def __init__(self, fingerprint: str, policy: TaskPolicy):
        self.fingerprint = fingerprint
        self.policy = policy
        self._nodes: dict[tuple[str, str], _Node] = {}
        self._by_state: dict[str, _Node] = {}  # state-changing nodes by the state they lead to

    def __len__(self) -> int:
        return len(self._nodes)

    def chain(self, history: Sequence[ToolCall], call: ToolCall) -> StateChain:
        return state_chain(self.fingerprint, [*history, call], self.policy)

    def lookup(self, history: Sequence[ToolCall], call: ToolCall) -> Hit | Match:
        chain = self.chain(history, call)
        last = chain.steps[-1]
        node = self._nodes.get((last.anchor, last.digest))
        if node is not None and self.policy.for_tool(call.tool).cacheable:
            return Hit(node.node_id, node.result, node.mutates)
        history_chain = StateChain(root=chain.root, steps=chain.steps[:-1])
        found = {
            step.state_key: self._ref(self._by_state[step.state_key])
            for step in history_chain.writes
            if step.state_key in self._by_state
        }
        return longest_prefix_match(history_chain, found)

    def seen(self, history: Sequence[ToolCall], call: ToolCall) -> bool:
        last = self.chain(history, call).steps[-1]
        return (last.anchor, last.digest) in self._nodes

    def record(self, history: Sequence[ToolCall], call: ToolCall, result: Any, *, mutated: bool | None = None) -> int:
        plan = record_plan(self.chain(history, call), self.policy, mutated)
        key = (plan.anchor, plan.digest)
        if key not in self._nodes:
            node = _Node(len(self._nodes) + 1, plan.state_key, plan.depth, result, plan.mutates)
            self._nodes[key] = node
            if plan.mutates:
                self._by_state[plan.state_key] = node
        return self._nodes[key].node_id

    def add_snapshot(self, node_id: int, snapshot_id: int) -> None:
        for node in self._by_state.values():
            if node.node_id == node_id:
                node.snapshot_id = snapshot_id

    @staticmethod
    def _ref(node: _Node) -> NodeRef:
        return NodeRef(node_id=node.node_id, state_key=node.state_key, depth=node.depth, snapshot_id=node.snapshot_id)
