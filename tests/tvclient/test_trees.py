"""tvclient.trees: packing groups counted against a trie of explicit token sequences, and the
export read page by page."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import random
from collections.abc import Iterable, Mapping

import pytest

from tvclient import trees

AT = "2026-11-27T10:00:00.123456Z"


def turn(prompt: int | None, completion: int | None = None, *, mutates: bool | None = True) -> dict:
    """A call the model made after seeing [0, prompt) and generating [prompt, completion)."""
    tokens = {}
    if prompt is not None:
        tokens["prompt"] = [0, prompt]
    if completion is not None:
        tokens["completion"] = [prompt or 0, completion]
    return {"tool": "bash", "mutates": mutates, "tokens": tokens or None}


def rollout(rollout_id: str, *calls: dict, branch: dict | None = None, epoch: int = 0) -> dict:
    return {
        "kind": "rollout",
        "rollout_id": rollout_id,
        "epoch": epoch,
        "trajectory_ref": f"traj-{rollout_id}",
        "branch": branch,
        "finished": True,
        "detached": False,
        "calls": [
            {
                "step": step,
                "node_id": 100 + step,
                "parent_id": None,
                "cached": False,
                "result_sha256": "ab" * 32,
                "exec_ms": 12.5,
                "at": AT,
                **call,
            }
            for step, call in enumerate(calls)
        ],
    }


def branch(origin: str, step: int, shared: int | None = None) -> dict:
    return {
        "rollout": origin,
        "step": step,
        "node_id": None,
        "tokens": None if shared is None else {"prompt": [0, shared]},
    }


def page(rollouts: Iterable[dict], *, epoch: int | None = 0, next: str | None = None) -> list[str]:
    rollouts = list(rollouts)
    items = [{"kind": "task", "task_id": "t", "epoch": epoch}, *rollouts]
    items.append({"kind": "end", "rollouts": len(rollouts), "next": next})
    return [json.dumps(item) + "\n" for item in items]


def export(*rollouts: dict) -> trees.Export:
    return trees.read_export(page(rollouts))


def trie_tokens(sequences: Iterable[list[int]]) -> int:
    """Tokens of the prefix tree holding every sequence: its nodes."""
    root: dict = {}
    count = 0
    for sequence in sequences:
        node = root
        for token in sequence:
            if token not in node:
                node[token], count = {}, count + 1
            node = node[token]
    return count


def sequences(model: Mapping[str, tuple[str | None, int, int]], prompt: int = 0) -> dict[str, list[int]]:
    """Explicit tokens for {rollout: (parent, shared, length)}, parents first: a root is fresh
    tokens after the `prompt` tokens common to the roots it shares them with (shared == prompt),
    a branch its parent's first `shared` tokens and fresh ones."""
    fresh = itertools.count(1)
    common = [-token for token in range(1, prompt + 1)]
    made: dict[str, list[int]] = {}
    for rollout_id, (parent, shared, length) in model.items():
        head = common[:shared] if parent is None else made[parent][:shared]
        made[rollout_id] = head + [next(fresh) for _ in range(length - shared)]
    return made


def shape(group: trees.PackingGroup) -> dict[str, tuple[str | None, int, int]]:
    return {t.rollout_id: (t.parent, t.shared, t.length) for t in group.trajectories}


def test_branches_share_their_origins_prefix_up_to_the_call_they_continue_after():
    root = rollout("r0", turn(20, 30), turn(40, 50, mutates=False), turn(50, 60), turn(70, 100, mutates=False))
    # Four samples after r0's second state-changing call (its completion ends at 60), 40 tokens each.
    branches = [rollout(f"b{i}", turn(70, 100), branch=branch("r0", 2)) for i in range(1, 5)]
    # A branch of b1 declared to share only its first 30 tokens, less than b1 shares with r0.
    deeper = rollout("c", turn(40, 50), branch=branch("b1", 1, shared=30))
    (group,) = trees.packing_groups(export(root, *branches, deeper))

    model = {
        "r0": (None, 0, 100),
        "b1": ("r0", 60, 100),
        "c": ("b1", 30, 50),
        "b2": ("r0", 60, 100),
        "b3": ("r0", 60, 100),
        "b4": ("r0", 60, 100),
    }
    assert shape(group) == model
    assert list(shape(group)) == list(model)  # depth first, children in export order
    assert [t.trajectory_ref for t in group.trajectories][:2] == ["traj-r0", "traj-b1"]
    made = sequences(model)
    assert (group.flat_tokens, group.tree_tokens) == (550, 100 + 4 * 40 + 20) == (550, trie_tokens(made.values()))
    assert group.sharing_ratio == trees.sharing_ratio([group]) == 550 / 280


@pytest.mark.parametrize(
    ("origin_calls", "branch_of", "branch_calls", "shared"),
    [
        ([turn(20, 30), turn(40, 60)], branch("o", 2), [turn(70, 90)], 60),
        ([turn(20, 30), turn(40, 60)], branch("o", 0), [turn(70, 90)], 0),  # the task's root
        ([turn(20, 30), turn(None, mutates=True)], branch("o", 2), [turn(70, 90)], 0),  # no tokens
        ([turn(20, 30), turn(40, None)], branch("o", 2), [turn(70, 90)], 40),  # its prompt ends before it
        ([turn(20, 30, mutates=None), turn(40, 60)], branch("o", 1), [turn(70, 90)], 30),  # evicted: counted
        ([turn(20, 30, mutates=False), turn(40, 60)], branch("o", 1), [turn(70, 90)], 60),  # read-only: skipped
        ([turn(20, 30)], branch("o", 3), [turn(70, 90)], 0),  # past the origin's known calls
        ([turn(20, 30), turn(40, 60)], branch("o", 2, shared=45), [turn(70, 90)], 45),  # declared wins
        ([turn(20, 30), turn(40, 60)], branch("o", 1, shared=80), [turn(70, 90)], 60),  # clipped to the origin
        ([turn(20, 30), turn(40, 60)], branch("o", 2), [], 0),  # clipped to the branch (no tokens yet)
    ],
)
def test_the_shared_length_is_declared_or_conservative(origin_calls, branch_of, branch_calls, shared):
    (group,) = trees.packing_groups(export(rollout("o", *origin_calls), rollout("b", *branch_calls, branch=branch_of)))
    (_, branched) = group.trajectories
    assert (branched.parent, branched.shared) == ("o", shared)
    assert group.tree_tokens == trie_tokens(sequences(shape(group)).values())


def test_a_branch_without_its_origin_in_the_export_is_a_root():
    rollouts = [
        rollout("o", turn(20, 60)),
        rollout("gone", turn(70, 90), branch=branch("elsewhere", 1)),  # another page, not read
        rollout("late", turn(70, 90), branch=branch("o", 1), epoch=1),  # trained in another step
        rollout("node", turn(10, 20), branch={"rollout": None, "step": None, "node_id": 7, "tokens": None}),
    ]
    groups = trees.packing_groups(export(*rollouts))
    assert [shape(group) for group in groups] == [
        {"o": (None, 0, 60)},
        {"gone": (None, 0, 90)},
        {"late": (None, 0, 90)},
        {"node": (None, 0, 20)},
    ]
    assert trees.sharing_ratio(groups) == 1.0


def test_shared_prompt_puts_an_epochs_roots_under_their_common_prompt():
    rollouts = [
        rollout("a", turn(120, 150)),
        rollout("b", turn(100, 140)),
        rollout("c"),  # no calls yet: shares nothing it is not known to
        rollout("d", turn(160, 200), branch=branch("a", 1)),
        rollout("e", turn(90, 100), epoch=1),
        rollout("f", turn(70, 90), branch=branch("elsewhere", 1)),  # a branch: no common prompt
    ]
    groups = trees.packing_groups(export(*rollouts), lengths={"c": 30, "other-task": 5}, shared_prompt=True)
    assert [(group.prompt, shape(group)) for group in groups] == [
        (100, {"a": (None, 100, 150), "d": ("a", 150, 200), "b": (None, 100, 140), "c": (None, 0, 30)}),
        (90, {"e": (None, 90, 100)}),
        (0, {"f": (None, 0, 90)}),
    ]
    for group in groups:
        assert group.tree_tokens == trie_tokens(sequences(shape(group), group.prompt).values())
    assert [(group.flat_tokens, group.tree_tokens) for group in groups] == [(520, 270), (100, 100), (90, 90)]
    assert trees.sharing_ratio(groups) == 710 / 460
    # Without it each root is a tree of its own.
    assert trees.sharing_ratio(trees.packing_groups(export(*rollouts), lengths={"c": 30})) == 710 / 560


def first_prompt(item: dict) -> int:
    tokens = item["calls"][0]["tokens"] if item["calls"] else None
    return (tokens or {}).get("prompt", [0, 0])[1]


def random_rollouts(
    rng: random.Random, shared_prompt: bool
) -> tuple[list[str], dict[str, int], dict[str, str | None], dict[str, list[int]]]:
    """Rollouts with a known tree: the export's lines, the lengths the trainer would pass, the
    expected parents and each rollout's explicit tokens as the token model builds them."""
    made: list[dict] = []
    expect: dict[str, tuple[str | None, int, int]] = {}  # rollout: (parent, shared, length)
    lengths: dict[str, int] = {}
    for index in range(rng.randint(1, 40)):
        rollout_id, epoch = f"r{index}", rng.choice([0, 0, 0, 1])
        ends = sorted(rng.sample(range(1, 400), 2 * rng.randint(0, 4)))
        calls = [
            turn(*(pair if rng.random() < 0.8 else (None,)), mutates=rng.choice([True, True, False, None]))
            for pair in zip(ends[::2], ends[1::2])
        ]
        origin = None
        if made and rng.random() < 0.75:  # often of a recent one: deep chains
            origin = rng.choice(made[-3:] if rng.random() < 0.6 else made)
        branch_of = None
        if origin is not None:
            unknown_or_mutating = [c for c in origin["calls"] if c["mutates"] is not False]
            step = rng.randint(0, len(unknown_or_mutating) + 1)
            declared = rng.randint(0, expect[origin["rollout_id"]][2] + 20) if rng.random() < 0.4 else None
            branch_of = branch(origin["rollout_id"] if rng.random() < 0.9 else "gone", step, declared)
        item = rollout(rollout_id, *calls, branch=branch_of, epoch=epoch)
        spans = [end for c in calls for _, end in (c["tokens"] or {}).values()]
        spans += [] if branch_of is None or branch_of["tokens"] is None else [branch_of["tokens"]["prompt"][1]]
        length = max(spans, default=0)
        if rng.random() < 0.3:
            length = lengths[rollout_id] = length + rng.randint(0, 30)
        parent, shared = None, 0
        if branch_of is not None and branch_of["rollout"] != "gone" and origin["epoch"] == epoch:
            parent = origin["rollout_id"]
            if branch_of["tokens"] is not None:
                shared = branch_of["tokens"]["prompt"][1]
            elif 0 < step <= len(unknown_or_mutating):
                span = unknown_or_mutating[step - 1]["tokens"]
                shared = 0 if span is None else span["completion"][1]
            shared = min(shared, expect[parent][2], length)
        made.append(item)
        expect[rollout_id] = (parent, shared, length)

    # Under shared_prompt the plain roots of an epoch share their first calls' shortest prompt.
    plain = [item for item in made if item["branch"] is None and first_prompt(item)] if shared_prompt else []
    prompts = {epoch: min((first_prompt(i) for i in plain if i["epoch"] == epoch), default=0) for epoch in (0, 1)}
    common = {epoch: [-1000 * (epoch + 1) - t for t in range(prompts[epoch])] for epoch in prompts}
    fresh = itertools.count()
    tokens: dict[str, list[int]] = {}
    for item in made:  # parents first
        rollout_id = item["rollout_id"]
        parent, shared, length = expect[rollout_id]
        if item in plain:
            shared = prompts[item["epoch"]]
            head = common[item["epoch"]]
        else:
            head = [] if parent is None else tokens[parent][:shared]
        tokens[rollout_id] = head + [next(fresh) for _ in range(length - shared)]
    if rng.random() < 0.3:  # children may come before their origins: the export's order is no contract
        rng.shuffle(made)
    return page(made, epoch=None), lengths, {r: p for r, (p, _, _) in expect.items()}, tokens


@pytest.mark.parametrize("shared_prompt", [False, True])
@pytest.mark.parametrize("seed", range(150))
def test_random_trees_count_the_tokens_of_a_trie_of_their_sequences(seed, shared_prompt):
    lines, lengths, parents, tokens = random_rollouts(random.Random(seed), shared_prompt)
    groups = trees.packing_groups(trees.read_export(lines), lengths=lengths, shared_prompt=shared_prompt)

    placed = [t for group in groups for t in group.trajectories]
    assert sorted(t.rollout_id for t in placed) == sorted(tokens)
    for group in groups:
        seen: set[str] = set()
        for t in group.trajectories:
            assert t.parent == parents[t.rollout_id]
            assert t.parent is None or t.parent in seen  # parents first, in the same group
            assert t.length == len(tokens[t.rollout_id])
            seen.add(t.rollout_id)
        members = [tokens[t.rollout_id] for t in group.trajectories]
        assert group.flat_tokens == sum(map(len, members))
        assert group.tree_tokens == trie_tokens(members)
    # Groups share no token: one trie over every sequence holds them all.
    flat, tree = sum(map(len, tokens.values())), trie_tokens(tokens.values())
    assert sum(group.tree_tokens for group in groups) == tree
    assert trees.sharing_ratio(groups) == (flat / tree if tree else 1.0)


def test_branch_origins_in_a_cycle_are_an_error():
    rollouts = [
        rollout("root", turn(10, 20)),
        rollout("a", turn(10, 20), branch=branch("b", 1)),
        rollout("b", turn(10, 20), branch=branch("a", 1)),
        rollout("c", turn(10, 20), branch=branch("a", 1)),
    ]
    with pytest.raises(ValueError, match="cycle: a, b, c"):
        trees.packing_groups(export(*rollouts))
    with pytest.raises(ValueError, match="cycle: self"):
        trees.packing_groups(export(rollout("self", branch=branch("self", 0))))


def test_a_length_below_the_token_spans_is_an_error():
    branched = export(rollout("o", turn(20, 60)), rollout("b", turn(70, 90), branch=branch("o", 1, shared=95)))
    assert [t.length for t in trees.packing_groups(branched, lengths={"b": 95})[0].trajectories] == [60, 95]
    with pytest.raises(ValueError, match="'b': length 94 is below its token spans' end 95"):
        trees.packing_groups(branched, lengths={"b": 94})


def test_a_rollout_twice_in_the_export_is_an_error():
    with pytest.raises(ValueError, match="'o' appears twice"):
        trees.packing_groups(export(rollout("o", turn(20, 60)), rollout("o")))


def test_read_export_parses_a_page():
    lines = [line.encode() for line in page([rollout("o", turn(20, 60), turn(None, mutates=None))], next="41")]
    parsed = trees.read_export(["", *lines[:2], b"  \n", *lines[2:]])
    assert (parsed.task_id, parsed.epoch, parsed.next) == ("t", 0, "41")
    (o,) = parsed.rollouts
    assert (o.rollout_id, o.epoch, o.trajectory_ref, o.branch, o.finished, o.detached) == (
        "o",
        0,
        "traj-o",
        None,
        True,
        False,
    )
    first, second = o.calls
    assert first == trees.Call(
        step=0,
        node_id=100,
        parent_id=None,
        tool="bash",
        mutates=True,
        cached=False,
        result_sha256="ab" * 32,
        exec_ms=12.5,
        at=dt.datetime(2026, 11, 27, 10, 0, 0, 123456, tzinfo=dt.UTC),
        prompt=trees.Span(0, 20),
        completion=trees.Span(20, 60),
    )
    assert (second.mutates, second.prompt, second.completion) == (None, None, None)
    (b,) = export(rollout("b", branch=branch("o", 2, shared=15))).rollouts
    assert b.branch == trees.Branch(rollout="o", step=2, node_id=None, prompt=trees.Span(0, 15))


class Pages:
    """A client whose export is split over pages, keyed by the cursor that asks for them."""

    def __init__(self, pages: dict[str | None, list[str]]) -> None:
        self.pages, self.asked = pages, []

    def tree_page(self, task_id: str, *, epoch: int | None, after: str | None) -> list[bytes]:
        self.asked.append((task_id, epoch, after))
        return [line.encode() for line in self.pages[after]]


def test_iter_export_merges_every_page_so_that_branches_find_their_origins():
    pages = {
        None: page([rollout("o", turn(20, 60), epoch=3)], epoch=3, next="1"),
        "1": page([], epoch=3, next="7"),
        "7": page([rollout("b", turn(70, 90), branch=branch("o", 1), epoch=3)], epoch=3),
    }
    client = Pages(pages)
    merged = trees.iter_export(client, "t", epoch=3)
    assert client.asked == [("t", 3, None), ("t", 3, "1"), ("t", 3, "7")]
    assert (merged.task_id, merged.epoch, merged.next) == ("t", 3, None)
    assert [r.rollout_id for r in merged.rollouts] == ["o", "b"]
    (group,) = trees.packing_groups(merged)
    assert shape(group) == {"o": (None, 0, 60), "b": ("o", 60, 90)}
    # The last page alone does not know the origin: its branch is a root.
    assert shape(trees.packing_groups(trees.read_export(pages["7"]))[0]) == {"b": (None, 0, 90)}


TASK = json.dumps({"kind": "task", "task_id": "t", "epoch": None})
END = json.dumps({"kind": "end", "rollouts": 0, "next": None})


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([TASK, '{"kind": "rollout", ', END], "line 2: not JSON"),
        ([TASK, '{"kind": "subtree"}', END], "line 2: unknown kind 'subtree'"),
        ([TASK, "[1, 2]", END], "line 2: unknown kind None"),
        ([END], "line 1: a end line out of place"),
        ([TASK, TASK, END], "line 2: a task line out of place"),
        ([TASK, END, json.dumps(rollout("o"))], "line 3: a rollout line out of place"),
        (
            [TASK, json.dumps({k: v for k, v in rollout("o").items() if k != "epoch"}), END],
            "line 2: the rollout line has no 'epoch'",
        ),
        (
            [TASK, json.dumps(rollout("o", {**turn(20, 60), "tokens": {"prompt": [9, 2]}})), END],
            "line 2: bad rollout line",
        ),
        ([TASK, json.dumps(rollout("o", {**turn(20, 60), "at": "yesterday"})), END], "line 2: bad rollout line"),
        ([TASK, json.dumps(rollout("o"))], "cut short"),
        ([TASK, json.dumps(rollout("o")), END], "counts 0 rollouts, the page held 1"),
    ],
)
def test_read_export_rejects_a_malformed_page(lines, message):
    with pytest.raises(ValueError, match=message):
        trees.read_export(lines)
