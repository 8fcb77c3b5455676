"""Random rollouts with injected faults, driven against the real service or client and judged by
the exactness referee (lab/replay/exactness/: `Referee`, where each property is defined).

Shared by the tool-server (tests/cache/test_exactness_properties.py) and client-mode
(tests/tvclient/test_exactness_properties.py) property tests. Rollouts of one task repeat each
other's calls for a while and then go their own way, interleaved at random; some of their calls
are struck by a fault (a timeout, an error after the call ran, a dying sandbox) that takes no,
part or all of the call's effect first, on the call itself or on the first call the service or
client executes for it (a replay). Two tools are nondeterministic (NONDETERMINISTIC); the
referee judges the other calls against a fresh sandbox per rollout.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from hypothesis import strategies as st
from hypothesis import target

from cache.models import Node, Snapshot
from cache.tcg import TaskPolicy
from lab.replay.exactness import Oracle, Outcome, Referee, Step, StoredNode, StoredSnapshot

SEED_FILES = {"a.txt": "A\n", "d/c.txt": "C\n"}
TOOLS = {
    "read_file": {"mutates_state": False},
    "list_dir": {"mutates_state": False},
    "sample": {"mutates_state": False},
}
POLICY = TaskPolicy.from_json(TOOLS)
# The determinism audit re-executes sampled hits at random: off here, so that what the
# store answers is a function of the scenario (the audit's own tests sample it). The referee's
# oracle is the longest-prefix graph, so the tasks match by history: a state-keyed hit (the
# default for new tasks) is one the graph does not hold; those are tested against their own
# oracle in tests/sandboxes/test_state_match.py.
TASK_SETTINGS = {"tools": TOOLS, "sandbox_budget": 64, "audit_rate": 0, "match": "history"}
# Nondeterministic tools: `stamp` writes a fresh random token to a file, `sample` answers one.
STAMP, SAMPLE = "stamp", "sample"
NONDETERMINISTIC = frozenset({STAMP, SAMPLE})
# Snapshots are taken where the path since the last one cost more than SNAPSHOT_COSTS (the tests
# fix the costs, so that where snapshots are taken does not depend on the machine's load): after
# every slow call, which takes SLOW_CALL_S, and never after quick ones alone.
SNAPSHOT_COSTS = (5.0, 5.0)  # snapshot_ms, restore_ms
SLOW_CALL_S = 0.012

PATHS = ["a.txt", "d/c.txt"]
CONTENTS = ["B\n", "AB\n"]  # half of each is another state: "B", "A"
PATCHES = [
    "--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-A\n+B\n",
    "--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-B\n+A\n",
    "--- /dev/null\n+++ b/e.txt\n@@ -0,0 +1 @@\n+E\n",
]


def call(tool: str, **args: Any) -> dict:
    return {"tool": tool, "args": args}


# Calls of the minimal failing examples that hypothesis found (tests pin them with @example).
WRITE_A = call("write_file", path="a.txt", content="B\n")
READ_A = call("read_file", path="a.txt")
READ_C = call("read_file", path="d/c.txt")
WRITE_C = call("write_file", path="d/c.txt", content="B\n")  # slow: a snapshot follows it


def is_slow(tool: str, args: Any) -> bool:
    return tool in ("apply_patch", STAMP) or (tool == "write_file" and args.get("path") == "d/c.txt")


def deterministic_calls(*, patches: bool) -> st.SearchStrategy[dict]:
    """Reads that see the writes (file contents) are drawn as often as writes."""
    read = st.builds(lambda p: call("read_file", path=p), st.sampled_from(PATHS))
    write = st.builds(
        lambda p, c: call("write_file", path=p, content=c), st.sampled_from(PATHS), st.sampled_from(CONTENTS)
    )
    other = [call("list_dir", path=".")] + ([call("apply_patch", patch=patch) for patch in PATCHES] if patches else [])
    return st.one_of(read, write, read, write, st.sampled_from(other))


def any_calls(*, patches: bool) -> st.SearchStrategy[dict]:
    stamp = st.builds(lambda p: call(STAMP, path=p), st.sampled_from(PATHS))
    nondeterministic = st.one_of(stamp, st.just(call(SAMPLE)))
    return st.one_of(deterministic_calls(patches=patches), nondeterministic)


@dataclass(frozen=True)
class Fault:
    kind: str  # "timeout": answers timed_out; "error": raises; "gone": the sandbox dies and it raises
    effect: str  # how much of the call ran first: "none", "partial", "full"
    on: str  # "call": the call's own execution; "first": the first execution it causes (a replay, if any)


def faults(kinds: tuple[str, ...]) -> st.SearchStrategy[Fault]:
    return st.builds(
        Fault, st.sampled_from(kinds), st.sampled_from(["none", "partial", "full"]), st.sampled_from(["call", "first"])
    )


@st.composite
def scenarios(
    draw,
    calls: st.SearchStrategy[dict],
    fault_kinds: tuple[str, ...],
    rollouts: int = 3,
    min_steps: int = 1,
    max_steps: int = 16,
) -> list[Step]:
    """Interleaved calls of a few rollouts, about half of them repeating what another rollout
    issued at the same point of its own run, now and then leaving out one of its calls (rollouts
    of a task start alike and part ways), and about one in three struck by a fault. A flat list,
    so that hypothesis shrinks it step by step."""
    maybe_fault = st.one_of(st.none(), st.none(), faults(fault_kinds))
    leader = st.one_of(st.none(), st.tuples(st.integers(0, rollouts - 1), st.sampled_from([0, 0, 0, 1])))
    raw = draw(
        st.lists(
            st.tuples(st.integers(0, rollouts - 1), leader, calls, maybe_fault), min_size=min_steps, max_size=max_steps
        )
    )
    issued: dict[int, list[dict]] = {r: [] for r in range(rollouts)}
    cursor = dict.fromkeys(range(rollouts), 0)  # how far each rollout is into the others' runs
    steps = []
    for r, follow, own, fault in raw:
        what = own
        if follow is not None and follow[0] != r:
            source, position = issued[follow[0]], cursor[r] + follow[1]
            if position < len(source):
                what, cursor[r] = source[position], position
        cursor[r] += 1
        issued[r].append(what)
        steps.append(Step(r, what, fault))
    return steps


class FaultPlan:
    """The fault armed for the step being driven; test sandboxes consult it on every execution."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: tuple[Fault, dict] | None = None
        self.fired = False

    def arm(self, fault: Fault | None, target: dict) -> None:
        with self._lock:
            self._armed = (fault, target) if fault is not None else None
            self.fired = False

    def take(self, tool: str, args: Any) -> Fault | None:
        """The fault that strikes this execution, if any (at most one per step)."""
        with self._lock:
            if self._armed is None:
                return None
            fault, target = self._armed
            if fault.on == "call" and (tool, dict(args)) != (target["tool"], target["args"]):
                return None
            self._armed, self.fired = None, True
            return fault

    def disarm(self) -> bool:
        with self._lock:
            self._armed = None
            return self.fired


FAULTS = FaultPlan()


def partial_args(tool: str, args: dict) -> dict | None:
    """Arguments that do part of the call's work (None: the tool has no part to do)."""
    if tool == "write_file":
        return {**args, "content": args["content"][: len(args["content"]) // 2]}
    return None


def timed_out_result() -> dict:
    return {"output": "the call timed out", "ok": False, "timed_out": True}


def token() -> str:
    return uuid.uuid4().hex


def folder_files(root: Path) -> dict[str, bytes]:
    """A folder's regular files by relative path: the whole state the directory tools see."""
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def scenario_referee(oracle_factory: Callable[[], Oracle], retired: tuple[str, ...] = ()) -> Referee:
    """The referee of these scenarios: their tool policy and nondeterministic tools."""
    return Referee(oracle_factory, policy=POLICY, nondeterministic=NONDETERMINISTIC, retired=retired)


def play(task_id: str, steps: list[Step], referee: Referee, run: Callable[[Step], Outcome]) -> None:
    """Drive the steps one after the other, each with its fault armed, and let the referee judge."""
    for index, step in enumerate(steps):
        before = Node.objects.filter(task_id=task_id).order_by("-id").values_list("id", flat=True).first() or 0
        FAULTS.arm(step.fault, step.call)
        try:
            outcome = run(step)
        finally:
            fired = FAULTS.disarm()
        outcome.fired = fired
        outcome.created = frozenset(Node.objects.filter(task_id=task_id, id__gt=before).values_list("id", flat=True))
        referee.observe(index, step, outcome)


def stored_nodes(task_id: str) -> list[StoredNode]:
    rows = Node.objects.filter(task_id=task_id).values_list("id", "anchor_key", "state_key", "call", "result_json")
    return [StoredNode(pk, anchor, state, c, orjson.loads(result)) for pk, anchor, state, c, result in rows]


def stored_snapshots(task_id: str, files: Callable[[str], dict[str, bytes] | None]) -> list[StoredSnapshot]:
    """Live snapshots with the files their ref holds (`files` answers None for a ref it cannot open)."""
    rows = Snapshot.objects.filter(task_id=task_id, status=Snapshot.Status.LIVE).values_list(
        "node_id", "node__state_key", "ref"
    )
    return [StoredSnapshot(node_id, state, held) for node_id, state, ref in rows if (held := files(ref)) is not None]


def snapshotted_nodes(task_id: str) -> set[int]:
    return set(Snapshot.objects.filter(task_id=task_id).values_list("node_id", flat=True))


def steer(referee: Referee) -> Referee:
    """Points hypothesis at runs where faults struck and others went on around them."""
    for label, score in referee.pressure.items():
        target(score, label=label)
    return referee
