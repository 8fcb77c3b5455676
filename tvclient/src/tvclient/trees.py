"""Prefix-tree packing groups for Tree Training, from the rollout tree export of a task.

Tree Training packs the trajectories that share a prefix into one tree, so the shared tokens are
computed once; it reports the sharing ratio, tokens in the flat batch / tokens in the tree. This
module is a reference implementation of that count from what tvcache knows of the rollouts
(GET /api/v1/tasks/{id}/tree, docs/design/tree-search.md), standard library only.

The token model. Token spans are half-open [start, end) offsets into a rollout's own tokens, as
the trainer declared them with its calls.

- A rollout's length L is the largest span end among its calls' tokens and its branch's tokens
  (0 if none), unless `lengths` gives it: only the trainer knows the tokens of the final answer,
  which is not a call. A given length below the spans' end is an error.
- A branch shares its origin's first S tokens: S is the end of its declared `branch.tokens.prompt`;
  otherwise the end of the `completion` of the origin's `step`-th state-changing call, whose
  observation is not counted as shared so that sharing is never over-stated (0 at step 0 or when
  that call has no tokens). S is clipped to the lengths of both.
- A branch whose origin is not in the export, or in another epoch (trained in another step),
  is the root of a group of its own: export every page (`iter_export`) to find the origins.
- With `shared_prompt`, the root rollouts (not branches) of an epoch also share their first
  call's prompt, a GRPO group's one prompt: they form one group under a virtual root of P tokens,
  P the smallest prompt end of their first calls. A root whose first call has no prompt span is
  taken to share none of it.
- Siblings differ right after what they share (distinct samples), so a group's tree holds
  P + sum(L - S) tokens, S of a root being P under `shared_prompt` (or 0), of a branch as above.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class Span:
    """Half-open [start, end) offsets into a rollout's tokens."""

    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Call:
    """One call of a rollout's path. An evicted node leaves its tool, kind and digest unknown."""

    step: int
    node_id: int | None
    parent_id: int | None
    tool: str | None
    mutates: bool | None
    cached: bool
    result_sha256: str | None
    exec_ms: float | None
    at: dt.datetime
    prompt: Span | None  # the context the model saw when it produced the call
    completion: Span | None  # the tokens it generated, containing the call


@dataclass(frozen=True, slots=True)
class Branch:
    """Where a rollout started: after the first `step` state-changing calls of `rollout`."""

    rollout: str | None  # None: started at a node, not from a rollout
    step: int | None
    node_id: int | None
    prompt: Span | None  # [0, S]: the origin's first S tokens, when the trainer declared them


@dataclass(frozen=True, slots=True)
class Rollout:
    rollout_id: str
    epoch: int
    trajectory_ref: str | None
    branch: Branch | None
    calls: tuple[Call, ...]
    finished: bool
    detached: bool


@dataclass(frozen=True, slots=True)
class Export:
    """A page of the export, or every page merged (`next` None)."""

    task_id: str
    epoch: int | None
    rollouts: tuple[Rollout, ...]
    next: str | None  # the cursor of the next page (?after=)


@dataclass(frozen=True, slots=True)
class Trajectory:
    """A rollout in its packing group: it shares its first `shared` tokens with `parent`."""

    rollout_id: str
    trajectory_ref: str | None
    parent: str | None  # None for a root, which shares the group's prompt (if any)
    shared: int
    length: int


@dataclass(frozen=True, slots=True)
class PackingGroup:
    """A tree of trajectories, parents before children, children in export order."""

    prompt: int  # tokens of the virtual root the roots share (shared_prompt), else 0
    trajectories: tuple[Trajectory, ...]

    @property
    def flat_tokens(self) -> int:
        return sum(t.length for t in self.trajectories)

    @property
    def tree_tokens(self) -> int:
        return self.prompt + sum(t.length - t.shared for t in self.trajectories)

    @property
    def sharing_ratio(self) -> float:
        return sharing_ratio([self])


class TreePages(Protocol):
    """What `iter_export` needs of a client (TVCacheClient has it)."""

    def tree_page(self, task_id: str, *, epoch: int | None, after: str | None) -> Iterable[bytes]: ...


def read_export(lines: Iterable[bytes | str]) -> Export:
    """One page of the export from its NDJSON lines. A page without its `end` line, or with fewer
    rollouts than that line counts, was cut short and is an error, not a smaller tree."""
    header: tuple[str, int | None] | None = None
    footer: tuple[int, str | None] | None = None
    rollouts: list[Rollout] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"line {number}: not JSON ({exc})") from None
        kind = item.get("kind") if isinstance(item, dict) else None
        if kind not in ("task", "rollout", "end"):
            raise ValueError(f"line {number}: unknown kind {kind!r}")
        if footer is not None or (kind == "task") != (header is None):
            raise ValueError(f"line {number}: a {kind} line out of place (task first, end last)")
        try:
            if kind == "task":
                header = (item["task_id"], item["epoch"])
            elif kind == "rollout":
                rollouts.append(_rollout(item))
            else:
                footer = (item["rollouts"], item["next"])
        except KeyError as exc:
            raise ValueError(f"line {number}: the {kind} line has no {exc}") from None
        except (AttributeError, TypeError, ValueError) as exc:
            raise ValueError(f"line {number}: bad {kind} line: {exc}") from None
    if header is None or footer is None:
        raise ValueError("the export ended before its end line: the page was cut short")
    if footer[0] != len(rollouts):
        raise ValueError(f"the end line counts {footer[0]} rollouts, the page held {len(rollouts)}")
    return Export(task_id=header[0], epoch=header[1], rollouts=tuple(rollouts), next=footer[1])


def iter_export(client: TreePages, task_id: str, *, epoch: int | None = None) -> Export:
    """The whole export, every page merged: a branch's origin may be on another page."""
    pages = [read_export(client.tree_page(task_id, epoch=epoch, after=None))]
    while pages[-1].next is not None:
        pages.append(read_export(client.tree_page(task_id, epoch=epoch, after=pages[-1].next)))
    rollouts = tuple(rollout for page in pages for rollout in page.rollouts)
    return Export(task_id=pages[0].task_id, epoch=pages[0].epoch, rollouts=rollouts, next=None)


def packing_groups(
    export: Export, *, lengths: Mapping[str, int] | None = None, shared_prompt: bool = False
) -> list[PackingGroup]:
    """The export's trajectories as prefix trees (the module docstring has the token model), in
    the order of their first root. `lengths` of rollouts not in the export are ignored, so that
    one mapping serves every task of a training step."""
    rollouts: dict[str, Rollout] = {}
    for rollout in export.rollouts:
        if rollouts.setdefault(rollout.rollout_id, rollout) is not rollout:
            raise ValueError(f"rollout {rollout.rollout_id!r} appears twice in the export")
    length = {rollout_id: _length(rollout, lengths) for rollout_id, rollout in rollouts.items()}
    children: dict[str, list[str]] = {rollout_id: [] for rollout_id in rollouts}
    parent: dict[str, str | None] = {}
    shared: dict[str, int] = {}
    roots: dict[tuple[str, object], list[Rollout]] = {}  # per group, in export order
    for rollout in export.rollouts:
        rollout_id, branch, origin = rollout.rollout_id, rollout.branch, _origin(rollout, rollouts)
        parent[rollout_id] = None if origin is None else origin.rollout_id
        if branch is not None and origin is not None:
            children[origin.rollout_id].append(rollout_id)
            shared[rollout_id] = min(_branch_shared(branch, origin), length[origin.rollout_id], length[rollout_id])
        elif shared_prompt and branch is None:
            roots.setdefault(("epoch", rollout.epoch), []).append(rollout)
        else:
            roots.setdefault(("rollout", rollout_id), []).append(rollout)

    groups = []
    for (grouping, _), members in roots.items():
        prompt = _common_prompt(members) if grouping == "epoch" else 0
        shared.update((root.rollout_id, prompt if _first_prompt(root) else 0) for root in members)
        trajectories = []
        stack = [root.rollout_id for root in reversed(members)]
        while stack:
            rollout_id = stack.pop()
            ref = rollouts[rollout_id].trajectory_ref
            trajectories.append(Trajectory(rollout_id, ref, parent[rollout_id], shared[rollout_id], length[rollout_id]))
            stack.extend(reversed(children[rollout_id]))
        groups.append(PackingGroup(prompt=prompt, trajectories=tuple(trajectories)))
    # Only rollouts whose origins lead round in a circle are reached from no root.
    unplaced = set(rollouts) - {t.rollout_id for group in groups for t in group.trajectories}
    if unplaced:
        raise ValueError(f"branch origins form a cycle: {', '.join(sorted(unplaced))}")
    return groups


def sharing_ratio(groups: Iterable[PackingGroup]) -> float:
    """Tokens in the flat batch / tokens in the trees (1.0 without tokens)."""
    flat = tree = 0
    for group in groups:
        flat, tree = flat + group.flat_tokens, tree + group.tree_tokens
    return flat / tree if tree else 1.0


def _length(rollout: Rollout, lengths: Mapping[str, int] | None) -> int:
    spans = [call.prompt for call in rollout.calls] + [call.completion for call in rollout.calls]
    if rollout.branch is not None:
        spans.append(rollout.branch.prompt)
    end = max((span.end for span in spans if span is not None), default=0)
    given = None if lengths is None else lengths.get(rollout.rollout_id)
    if given is None:
        return end
    if given < end:
        raise ValueError(f"rollout {rollout.rollout_id!r}: length {given} is below its token spans' end {end}")
    return given


def _origin(rollout: Rollout, rollouts: Mapping[str, Rollout]) -> Rollout | None:
    """The rollout this one branched from, if it is in the export and trained with it."""
    branch = rollout.branch
    origin = rollouts.get(branch.rollout) if branch is not None and branch.rollout is not None else None
    return origin if origin is not None and origin.epoch == rollout.epoch else None


def _branch_shared(branch: Branch, origin: Rollout) -> int:
    """What the branch shares of its origin, before clipping: declared, else the end of the
    tokens that made the origin's `step`-th state-changing call (its observation may differ). A
    call of unknown kind (its node evicted) counts as one: an earlier call, so fewer tokens."""
    if branch.prompt is not None:
        return branch.prompt.end
    if not branch.step:
        return 0
    calls = [call for call in origin.calls if call.mutates is not False]
    if len(calls) < branch.step:
        return 0
    span = calls[branch.step - 1].completion or calls[branch.step - 1].prompt  # the prompt ends before it
    return 0 if span is None else span.end


def _first_prompt(rollout: Rollout) -> int:
    span = rollout.calls[0].prompt if rollout.calls else None
    return 0 if span is None else span.end


def _common_prompt(roots: list[Rollout]) -> int:
    return min((p for p in map(_first_prompt, roots) if p), default=0)


def _span(value: Any) -> Span | None:
    if value is None:
        return None
    start, end = value
    if not (type(start) is int and type(end) is int and 0 <= start <= end):
        raise ValueError(f"token span {value!r} is not [start, end] with 0 <= start <= end")
    return Span(start, end)


def _call(item: Mapping[str, Any]) -> Call:
    tokens = item["tokens"] or {}
    return Call(
        step=item["step"],
        node_id=item["node_id"],
        parent_id=item["parent_id"],
        tool=item["tool"],
        mutates=item["mutates"],
        cached=item["cached"],
        result_sha256=item["result_sha256"],
        exec_ms=item["exec_ms"],
        at=dt.datetime.fromisoformat(item["at"]),
        prompt=_span(tokens.get("prompt")),
        completion=_span(tokens.get("completion")),
    )


def _rollout(item: Mapping[str, Any]) -> Rollout:
    branch = item["branch"]
    if branch is not None:
        branch = Branch(
            rollout=branch["rollout"],
            step=branch["step"],
            node_id=branch["node_id"],
            prompt=_span((branch["tokens"] or {}).get("prompt")),
        )
    return Rollout(
        rollout_id=item["rollout_id"],
        epoch=item["epoch"],
        trajectory_ref=item["trajectory_ref"],
        branch=branch,
        calls=tuple(map(_call, item["calls"])),
        finished=item["finished"],
        detached=item["detached"],
    )
