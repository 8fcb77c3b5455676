"""Reads behind the rollout tree page: an epoch's rollouts nested under the rollouts they branched
from, and the sharing ratio of Tree Training. Both come from the tree export
(cache.services.trees), counted by `tvclient.trees`, the one home of the token model.

Every read is bounded, whatever the size of the task (dashboard/README.md says why these bounds):
the tree shows one page of the export, and sharing ratios read whole epochs only while the
request's reads stay under RATIO_ROLLOUTS rollouts and RATIO_CALLS calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models import Count, Q, Sum

from cache import ledger
from cache import selectors as cache_selectors
from cache.models import Rollout
from cache.services.trees import tree_export
from tvclient import trees

PAGE_ROLLOUTS = 200
RATIO_ROLLOUTS = 2_000
RATIO_CALLS = 50_000  # by the rollouts' call counters: an export holds about one line per call


@dataclass(frozen=True, slots=True)
class Sharing:
    """Tokens of the flat batch and of its prefix trees; `ratio` None when no token was given."""

    flat: int
    tree: int
    ratio: float | None


def tree_page(*, task_id: str, epoch: int | None, after: int = 0) -> dict[str, Any]:
    """One page of an epoch's rollout tree (default: the latest epoch that has rollouts), and the
    sharing ratios of the epochs whose exports fit the request's bounds."""
    task = cache_selectors.task_get(task_id=task_id)
    ledger.ledger_flush()  # this process's counters and steps, as the export does
    epochs = tree_epochs(task_id=task_id)
    if epoch is None and epochs:
        epoch = epochs[0]["epoch"]
    shown = next((row for row in epochs if row["epoch"] == epoch), None)
    wholes = _whole_epochs(task_id, epochs, shown)
    for row in epochs:
        whole = wholes.get(row["epoch"])
        row["sharing"] = None if whole is None else _sharing(whole, shared_prompt=False)
        row["sharing_prompt"] = None if whole is None else _sharing(whole, shared_prompt=True)
    whole = wholes.get(epoch)
    if epoch is None:
        page = trees.Export(task_id, None, (), None)
    elif whole is not None and after == 0 and len(whole.rollouts) <= PAGE_ROLLOUTS:
        page = whole
    else:
        page = _export(task_id, epoch, after, PAGE_ROLLOUTS)
    rows, problem = tree_rows(task_id=task_id, export=page)
    return {
        "task": task,
        "epoch": epoch,
        "epochs": epochs,
        "shown": shown,
        "rows": rows,
        "problem": problem,
        "next": page.next,
        "epoch_read": whole is not None,
        "page_sharing": None if whole is not None else _sharing(page, shared_prompt=False),
        "page_rollouts": PAGE_ROLLOUTS,
        "ratio_bounds": {"rollouts": RATIO_ROLLOUTS, "calls": RATIO_CALLS},
    }


def tree_epochs(*, task_id: str) -> list[dict[str, Any]]:
    """The task's epochs that have rollouts, newest first: rollouts, branches and calls of each."""
    branch = ~Q(branch_of="") | Q(branch_node__isnull=False)
    return list(
        Rollout.objects.filter(task_id=task_id)
        .values("epoch")
        .annotate(rollouts=Count("id"), branches=Count("id", filter=branch), calls=Sum("calls"))
        .order_by("-epoch")
    )


def tree_rows(*, task_id: str, export: trees.Export) -> tuple[list[dict[str, Any]], str]:
    """The page's rollouts as rows of a tree, parents before children, each with its depth; and
    what went wrong if the branch origins do not form a tree (then the rows are flat)."""
    placed, problem = _placed(export)
    rollouts = {rollout.rollout_id: rollout for rollout in export.rollouts}
    origins = {r.branch.rollout for r in export.rollouts if r.branch and r.branch.rollout} - set(rollouts)
    known = {
        rollout_id: (calls, hits, epoch)
        for rollout_id, calls, hits, epoch in Rollout.objects.filter(
            task_id=task_id, rollout_id__in=[*rollouts, *origins]
        ).values_list("rollout_id", "calls", "hits", "epoch")
    }
    depth: dict[str, int] = {}
    rows = []
    for trajectory in placed:
        rollout = rollouts[trajectory.rollout_id]
        depth[rollout.rollout_id] = 0 if trajectory.parent is None else depth[trajectory.parent] + 1
        calls, hits, _ = known.get(rollout.rollout_id, (len(rollout.calls), sum(c.cached for c in rollout.calls), 0))
        tokens = not problem and _has_tokens(rollout)
        rows.append(
            {
                "rollout_id": rollout.rollout_id,
                "trajectory_ref": rollout.trajectory_ref,
                "parent": trajectory.parent,
                "depth": depth[rollout.rollout_id],
                "branch": rollout.branch,
                "origin_elsewhere": _origin_elsewhere(rollout, rollouts, known),
                "calls": calls,
                "hits": hits,
                "finished": rollout.finished,
                "detached": rollout.detached,
                "shared": trajectory.shared if tokens and trajectory.parent is not None else None,
                "length": trajectory.length if tokens else None,
            }
        )
    return rows, problem


def _placed(export: trees.Export) -> tuple[list[trees.Trajectory], str]:
    """The page's trajectories, parents before children; flat, with what went wrong, when the
    branch origins do not form a tree (they lead round in a circle)."""
    try:
        return [t for group in trees.packing_groups(export) for t in group.trajectories], ""
    except ValueError as exc:
        return [trees.Trajectory(r.rollout_id, r.trajectory_ref, None, 0, 0) for r in export.rollouts], str(exc)


def _whole_epochs(task_id: str, epochs: list[dict[str, Any]], shown: dict[str, Any] | None) -> dict[int, trees.Export]:
    """Whole epochs' exports within the bounds: every epoch, read at once, when the whole task
    fits; else the shown epoch when it fits; else none. Part of an epoch is not its ratio, so a
    read cut short by the bound (the epoch grew meanwhile) counts for nothing."""
    if _fits(epochs):
        export = _export(task_id, None, 0, RATIO_ROLLOUTS)
        if export.next is None:
            split: dict[int, list[trees.Rollout]] = {}
            for rollout in export.rollouts:
                split.setdefault(rollout.epoch, []).append(rollout)
            return {epoch: trees.Export(export.task_id, epoch, tuple(rows), None) for epoch, rows in split.items()}
    if shown is not None and _fits([shown]):
        export = _export(task_id, shown["epoch"], 0, RATIO_ROLLOUTS)
        if export.next is None:
            return {shown["epoch"]: export}
    return {}


def _fits(epochs: list[dict[str, Any]]) -> bool:
    rollouts = sum(row["rollouts"] for row in epochs)
    return rollouts <= RATIO_ROLLOUTS and sum(row["calls"] or 0 for row in epochs) <= RATIO_CALLS


def _export(task_id: str, epoch: int | None, after: int, limit: int) -> trees.Export:
    blocks = tree_export(task_id=task_id, epoch=epoch, after=after, limit=limit)
    return trees.read_export(line for block in blocks for line in block.splitlines())


def _sharing(export: trees.Export, *, shared_prompt: bool) -> Sharing | None:
    """None when the branch origins do not form a tree (the page says why)."""
    try:
        groups = trees.packing_groups(export, shared_prompt=shared_prompt)
    except ValueError:
        return None
    flat = sum(group.flat_tokens for group in groups)
    tree = sum(group.tree_tokens for group in groups)
    return Sharing(flat=flat, tree=tree, ratio=trees.sharing_ratio(groups) if flat else None)


def _has_tokens(rollout: trees.Rollout) -> bool:
    spans = [span for call in rollout.calls for span in (call.prompt, call.completion)]
    return any(span is not None for span in spans) or bool(rollout.branch and rollout.branch.prompt)


def _origin_elsewhere(rollout: trees.Rollout, page: dict[str, trees.Rollout], known: dict) -> str:
    """Where a branch's origin is when it is not on this page."""
    origin = rollout.branch.rollout if rollout.branch else None
    if origin is None or origin in page:
        return ""
    if origin not in known:
        return "unknown rollout"
    if known[origin][2] != rollout.epoch:
        return f"epoch {known[origin][2]}"
    return "another page"
