"""Eviction scoring: which live snapshots to drop first when a task is over its budget of
snapshots, and which results (nodes) when it is over its retention policy's bounds.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

HIT_HALF_LIFE_S = 3600.0


@dataclass(frozen=True, slots=True)
class SnapshotCandidate:
    snapshot_id: int
    hit_count: int  # hits on the node and its subtree's direct children
    children: int
    depth: int
    rebuild_ms: float  # cost to rebuild the state from the nearest other snapshot or root
    idle_s: float  # seconds since the node last hit or was created
    leased: bool = False
    pinned: bool = False


def reuse_score(candidate: SnapshotCandidate) -> float:
    """Expected value of keeping the snapshot: likely reuse times the cost it saves.

    Recent hits and many children make reuse likely; depth makes a state more specific;
    idleness decays the evidence with a one-hour half-life.
    """
    decay = 0.5 ** (candidate.idle_s / HIT_HALF_LIFE_S)
    reuse = (1.0 + candidate.hit_count + candidate.children) * decay / (1.0 + candidate.depth)
    return reuse * (1.0 + candidate.rebuild_ms)


def eviction_order(candidates: list[SnapshotCandidate], over_budget: int) -> list[int]:
    """The ids of up to `over_budget` snapshots to evict, least valuable first.

    Leased and pinned snapshots are never chosen, so the result may be shorter than asked.
    """
    if over_budget <= 0:
        return []
    evictable = [c for c in candidates if not c.leased and not c.pinned]
    evictable.sort(key=lambda c: (reuse_score(c), c.snapshot_id))
    return [c.snapshot_id for c in evictable[:over_budget]]


# Retention: which nodes (results) to delete when a task keeps more nodes or result bytes than its
# policy allows (docs/operations/retention.md).


@dataclass(frozen=True, slots=True)
class RetentionBudget:
    """A task's bounds; None: unbounded."""

    max_nodes: int | None = None
    max_result_bytes: int | None = None

    @property
    def bounded(self) -> bool:
        return self.max_nodes is not None or self.max_result_bytes is not None

    def over(self, nodes: int, result_bytes: int) -> tuple[int, int]:
        """How many nodes and result bytes the task keeps beyond its bounds (0 within)."""
        return (
            max(0, nodes - self.max_nodes) if self.max_nodes is not None else 0,
            max(0, result_bytes - self.max_result_bytes) if self.max_result_bytes is not None else 0,
        )


@dataclass(frozen=True, slots=True)
class NodeCandidate:
    node_id: int
    parent_id: int | None  # None, or a node not among the candidates: the root of a subtree
    depth: int
    result_bytes: int
    hit_count: int
    exec_ms: float  # what a miss costs at least to get the result again: executing the call
    idle_s: float  # seconds since the node last hit or was created
    # Never evicted, and so neither are its ancestors: pinned, used within the live window, the
    # anchor of a call being executed, holding a snapshot or leased (the service decides).
    protected: bool = False


def node_reuse_score(candidate: NodeCandidate) -> float:
    """Expected value of keeping a result, as `reuse_score` values a snapshot: hits decayed by
    idleness (one-hour half-life), shallower states more shared, times the execution it saves."""
    decay = 0.5 ** (candidate.idle_s / HIT_HALF_LIFE_S)
    reuse = (1.0 + candidate.hit_count) * decay / (1.0 + candidate.depth)
    return reuse * (1.0 + candidate.exec_ms)


def retention_order(candidates: list[NodeCandidate], budget: RetentionBudget) -> list[int]:
    """The ids of the nodes to evict until the task is within `budget`, in an order where every
    node comes after all its descendants (leaves and cold subtrees first, so what stays is closed
    under prefixes: a node's parent is never evicted before it, and any prefix of the order may
    be evicted alone). `candidates` are all the task's nodes, which the totals count.

    A subtree is worth the most any of its nodes is worth (reaching a node takes its path), so a
    cold subtree goes whole before a warmer one loses a leaf. When only the bytes are over, the
    value is taken per byte freed. Protected nodes and their ancestors are never chosen, so the
    task may stay over budget."""
    nodes_over, bytes_over = budget.over(len(candidates), sum(c.result_bytes for c in candidates))
    if not nodes_over and not bytes_over:
        return []
    by_id = {c.node_id: c for c in candidates}
    children: dict[int, list[int]] = {}
    for c in candidates:
        if c.parent_id in by_id:
            children.setdefault(c.parent_id, []).append(c.node_id)
    spared = _spared(candidates, by_id)
    value = _subtree_values(candidates, children)
    per_byte = bool(bytes_over) and not nodes_over

    def key(node_id: int) -> tuple[float, int, int]:
        c = by_id[node_id]
        worth = value[node_id] / (1.0 + c.result_bytes) if per_byte else value[node_id]
        return (worth, -c.result_bytes, node_id)

    waiting = {node_id: len(kids) for node_id, kids in children.items()}
    heap = [key(c.node_id) for c in candidates if c.node_id not in spared and not waiting.get(c.node_id)]
    heapq.heapify(heap)
    order: list[int] = []
    while heap and (nodes_over > 0 or bytes_over > 0):
        node_id = heapq.heappop(heap)[2]
        c = by_id[node_id]
        order.append(node_id)
        nodes_over -= 1
        bytes_over -= c.result_bytes
        parent = c.parent_id
        if parent in waiting:
            waiting[parent] -= 1
            if waiting[parent] == 0 and parent not in spared:
                heapq.heappush(heap, key(parent))
    return order


def _spared(candidates: list[NodeCandidate], by_id: dict[int, NodeCandidate]) -> set[int]:
    """Protected nodes and their ancestors."""
    spared: set[int] = set()
    for c in candidates:
        node = c if c.protected else None
        while node is not None and node.node_id not in spared:
            spared.add(node.node_id)
            node = by_id.get(node.parent_id) if node.parent_id is not None else None
    return spared


def _subtree_values(candidates: list[NodeCandidate], children: dict[int, list[int]]) -> dict[int, float]:
    """Each node's value: the most of its own score and its children's values (iterative, in
    post-order: a graph may be thousands of calls deep)."""
    value: dict[int, float] = {}
    by_id = {c.node_id: c for c in candidates}
    for c in candidates:
        if c.node_id in value:
            continue
        stack = [(c.node_id, False)]
        while stack:
            node_id, expanded = stack.pop()
            if node_id in value:
                continue
            kids = children.get(node_id, ())
            if expanded or not kids:
                own = node_reuse_score(by_id[node_id])
                value[node_id] = max([own, *(value[k] for k in kids)])
            else:
                stack.append((node_id, True))
                stack.extend((k, False) for k in kids if k not in value)
    return value
