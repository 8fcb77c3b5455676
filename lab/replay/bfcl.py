"""The bfcl workload: BFCL v4 multi-turn tasks (bfcl-eval) as tvclient environments.

bfcl-eval ships 200 multi-turn base tasks, each with an initial state and ground-truth call
sequences over pure-Python stateful tool classes (file system, messaging, posting, tickets,
trading, travel, vehicle, math). `BfclEnvironment` loads a task's classes like bfcl-eval's own
executor does and answers each call with the string bfcl-eval would; fork() is a deep copy of
the instances (their seeded random generators included). The service cannot run Python tool
classes, so this workload runs in client mode only.

Which tools mutate state is measured, not guessed (`calibrate`): every ground-truth call of every
task, and the calls of the seeded rollouts, runs on a copy of the state, and a tool is read-only
only if no observed call changed the pickled state of the task's instances (files, balances,
cursors, seeded random generators: anything an instance holds) and each call answered the same
twice from the same state. Tools never observed keep the safe default (mutating). The result is
`data/bfcl_tool_effects.json`; regenerate it with `manage.py replay_bfcl --calibrate`.
"""

from __future__ import annotations

import ast
import copy
import decimal
import importlib
import inspect
import json
import pickle
import random
import threading
from collections import Counter
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

from tvclient import ToolExecutionEnvironment

from .workload import Call, ReplayTask, Workload

DATA = Path(__file__).with_name("data")
EFFECTS_PATH = DATA / "bfcl_tool_effects.json"
CATEGORY = "BFCL_v4_multi_turn_base.json"
# bfcl-eval's tools keep some state outside their instances, which the replay found as hits
# and misses answering differently from a fresh execution: MathAPI sets mpmath's process-wide
# precision (mpmath.mp.dps) and the thread's decimal context, and TwitterAPI.post_tweet stores
# its mutable default arguments (tags=[], mentions=[]) in tweets that later calls append to,
# sharing one list between every sandbox of the process. Tools also keep the argument objects
# they are given (post_tweet stores `mentions`, `mention` appends to it), which would change the
# caller's call. Calls therefore run one at a time, from the default precision and a fresh decimal
# context, on a deep copy of their arguments plus fresh copies of mutable defaults.
_EXECUTION_LOCK = threading.Lock()


@lru_cache(maxsize=1)
def _backend_config():
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING, STATELESS_CLASSES

    return CLASS_FILE_PATH_MAPPING, frozenset(STATELESS_CLASSES)


@lru_cache(maxsize=1)
def load_entries() -> list[dict[str, Any]]:
    """The multi-turn base tasks with their ground truth, in file order."""
    import bfcl_eval

    root = Path(bfcl_eval.__file__).parent / "data"
    answers = {}
    for line in (root / "possible_answer" / CATEGORY).read_text().splitlines():
        row = json.loads(line)
        answers[row["id"]] = row["ground_truth"]
    entries = []
    for line in (root / CATEGORY).read_text().splitlines():
        row = json.loads(line)
        entries.append(
            {
                "id": row["id"],
                "initial_config": row["initial_config"],
                "involved_classes": row["involved_classes"],
                "ground_truth": answers[row["id"]],
            }
        )
    return entries


def _class(name: str):
    mapping, _ = _backend_config()
    return getattr(importlib.import_module(mapping[name]), name)


def method_owner(involved_classes: list[str]) -> dict[str, str]:
    """Public method name -> class, the last involved class winning, as bfcl-eval resolves it."""
    owner = {}
    for name in involved_classes:
        for method, _ in inspect.getmembers(_class(name), predicate=inspect.isfunction):
            if not method.startswith("_"):
                owner[method] = name
    return owner


def parse_call(text: str, owner: dict[str, str]) -> Call:
    """'cd(folder="x")' -> {"tool": "GorillaFileSystem.cd", "args": {"folder": "x"}} (positional
    arguments named from the method's signature)."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain call: {text!r}")
    cls = owner[node.func.id]
    params = [p for p in inspect.signature(getattr(_class(cls), node.func.id)).parameters if p != "self"]
    args = {params[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
    args.update({kw.arg: ast.literal_eval(kw.value) for kw in node.keywords})
    return {"tool": f"{cls}.{node.func.id}", "args": json.loads(json.dumps(args))}


def ground_truth_calls(entry: dict[str, Any]) -> list[Call]:
    owner = method_owner(entry["involved_classes"])
    return [parse_call(text, owner) for turn in entry["ground_truth"] for text in turn]


def _answer(value: Any) -> str:
    # bfcl-eval's own conversion of a tool's return value to what the model reads.
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


class BfclEnvironment(ToolExecutionEnvironment):
    backend = "bfcl-python"

    def __init__(self, entry: dict[str, Any], read_only: frozenset[str] = frozenset()):
        self.entry = entry
        self.read_only = read_only
        self.instances: dict[str, Any] = {}
        self.size_bytes = 0

    def start(self) -> None:
        _, stateless = _backend_config()
        self.instances = {}
        for name in self.entry["involved_classes"]:
            instance = _class(name)()
            if name not in stateless:
                instance._load_scenario(copy.deepcopy(self.entry["initial_config"].get(name, {})), long_context=False)
            self.instances[name] = instance

    def execute(self, call: Call) -> dict[str, Any]:
        import mpmath

        cls, _, method = call["tool"].partition(".")
        with _EXECUTION_LOCK, decimal.localcontext(decimal.Context()):
            mpmath.mp.dps = 15
            try:
                function = getattr(self.instances[cls], method)
                return {"output": _answer(function(**_with_fresh_defaults(function, call["args"])))}
            except Exception as exc:  # bfcl-eval shows the model the error text
                return {"output": f"Error during execution: {exc}"}

    def execute_observed(self, call: Call) -> tuple[dict[str, Any], bool | None]:
        """A call of a state-changing tool that left the pickled tool instances as they were (a
        `cd` into a missing folder, a failed order) changed nothing, as the calibration sees it.
        Equal states may pickle differently (a set's order): that only reads as a change."""
        if not self.mutates_state(call):
            return self.execute(call), None
        before = self.state()
        result = self.execute(call)
        return result, self.state() != before

    def fork(self) -> BfclEnvironment:
        twin = BfclEnvironment(self.entry, self.read_only)
        twin.instances = copy.deepcopy(self.instances)
        twin.size_bytes = len(pickle.dumps(twin.instances))
        return twin

    def stop(self) -> None:
        self.instances = {}

    def mutates_state(self, call: Call) -> bool:
        return call["tool"] not in self.read_only

    def state(self) -> bytes:
        return pickle.dumps(self.instances)


def _with_fresh_defaults(function, args: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments plus a private copy of every mutable default it leaves out."""
    out = copy.deepcopy(args)
    for name, param in inspect.signature(function).parameters.items():
        if name not in out and isinstance(param.default, (list, dict, set)):
            out[name] = copy.deepcopy(param.default)
    return out


def load_effects() -> dict[str, Any]:
    return json.loads(EFFECTS_PATH.read_text())


def read_only_tools(effects: dict[str, Any]) -> frozenset[str]:
    return frozenset(tool for tool, row in effects["tools"].items() if not row["mutates_state"])


# ---------------------------------------------------------------------------------------------
# Rollouts: seeded edits of the ground truth


def _alternative(value: Any, rng: random.Random, pool: list[Any]) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + rng.choice([-1, 1, 2])
    if isinstance(value, float):
        return round(value * rng.choice([0.9, 1.1]), 2)
    if isinstance(value, str):
        others = [p for p in pool if isinstance(p, str) and p != value]
        return rng.choice(others) if others and rng.random() < 0.7 else value + "_2"
    return value


def edit_rollout(calls: list[Call], read_only: frozenset[str], rng: random.Random) -> list[Call]:
    """One rollout: the ground truth with read-only calls dropped, repeated or swapped, now and
    then an alternative argument (mostly late: rollouts share their start), sometimes cut short."""
    pool = [v for c in calls for v in c["args"].values()]
    out: list[Call] = []
    for call in calls:
        ro = call["tool"] in read_only
        if ro and rng.random() < 0.15:
            continue
        out.append(copy.deepcopy(call))
        if ro and rng.random() < 0.1:
            out.append(copy.deepcopy(call))
    for i in range(len(out) - 1):
        if out[i]["tool"] in read_only and out[i + 1]["tool"] in read_only and rng.random() < 0.3:
            out[i], out[i + 1] = out[i + 1], out[i]
    if out and rng.random() < 0.35:
        start = len(out) // 2 if rng.random() < 0.75 else 0
        i = rng.randrange(start, len(out))
        if out[i]["args"]:
            key = rng.choice(sorted(out[i]["args"]))
            out[i]["args"][key] = _alternative(out[i]["args"][key], rng, pool)
    if len(out) > 2 and rng.random() < 0.1:
        out = out[: rng.randint(len(out) // 2, len(out) - 1)]
    return out


class BfclWorkload(Workload):
    name = "bfcl"

    def __init__(self, *, tasks: int, rollouts: int, seed: int, effects: dict[str, Any] | None = None):
        self.entries = load_entries()[:tasks]
        self.n_rollouts = rollouts
        self.seed = seed
        self.effects = effects if effects is not None else load_effects()
        self.read_only = read_only_tools(self.effects)
        self._truth = {e["id"]: ground_truth_calls(e) for e in self.entries}

    def describe(self) -> dict[str, Any]:
        return {
            "bfcl_eval_version": metadata.version("bfcl-eval"),
            "category": CATEGORY,
            "read_only_tools": sorted(self.read_only),
            "effects_file": str(EFFECTS_PATH.name),
        }

    def tasks(self) -> list[ReplayTask]:
        tools = {tool: {"mutates_state": False, "cacheable": True} for tool in sorted(self.read_only)}
        out = []
        for entry in self.entries:
            env = {
                "backend": "external",
                "workload": "bfcl",
                "task": entry["id"],
                "bfcl_eval": metadata.version("bfcl-eval"),
                "initial_config": entry["initial_config"],
            }
            out.append(
                ReplayTask(
                    entry["id"].replace("_", "-"),
                    tools,
                    env,
                    None,
                    lambda entry=entry: BfclEnvironment(entry, self.read_only),
                )
            )
        return out

    def rollouts(self, task: ReplayTask, epoch: int) -> list[list[Call]]:
        entry_id = task.name.replace("-", "_")
        truth = self._truth[entry_id]
        return [
            edit_rollout(truth, self.read_only, random.Random(f"{self.seed}-{entry_id}-{epoch}-{index}"))
            for index in range(self.n_rollouts)
        ]


# ---------------------------------------------------------------------------------------------
# Calibration


def calibrate(*, rollouts: int = 4, epochs: int = 2, seed: int = 1) -> dict[str, Any]:
    """Run every ground-truth call (and the calls of seeded rollouts, whose edits assume the
    previous annotation) and record, per tool, calls observed and calls that changed state."""
    observed: Counter[str] = Counter()
    changed: Counter[str] = Counter()
    unstable: Counter[str] = Counter()
    known: set[str] = set()
    previous = read_only_tools(load_effects()) if EFFECTS_PATH.exists() else frozenset()
    for entry in load_entries():
        for name in entry["involved_classes"]:
            known.update(
                f"{name}.{m}"
                for m, _ in inspect.getmembers(_class(name), predicate=inspect.isfunction)
                if not m.startswith("_")
            )
        truth = ground_truth_calls(entry)
        sequences = [truth] + [
            edit_rollout(truth, previous, random.Random(f"{seed}-{entry['id']}-{e}-{r}"))
            for e in range(epochs)
            for r in range(rollouts)
        ]
        for calls in sequences:
            env = BfclEnvironment(entry)
            env.start()
            for call in calls:
                twin = env.fork()
                before = env.state()
                result = env.execute(call)
                observed[call["tool"]] += 1
                if env.state() != before:
                    changed[call["tool"]] += 1
                if twin.execute(call) != result:
                    unstable[call["tool"]] += 1
    tools = {}
    for tool in sorted(known):
        mutates = observed[tool] == 0 or changed[tool] > 0 or unstable[tool] > 0
        tools[tool] = {
            "mutates_state": mutates,
            "calls_observed": observed[tool],
            "calls_changing_state": changed[tool],
            "calls_answering_differently": unstable[tool],
        }
    return {
        "bfcl_eval_version": metadata.version("bfcl-eval"),
        "category": CATEGORY,
        "method": "Per tool: every ground-truth call of the 200 tasks plus the calls of "
        f"{rollouts} seeded rollouts x {epochs} epochs per task, each run on a deep copy of the task's "
        "state; a call changes state when the pickle of the task's tool instances differs after it; "
        "it answers differently when a copy of the state from before answers the same call "
        "differently. Read-only = observed, never changed state, always answered the same. "
        "Never observed = mutating (the safe default).",
        "tools": tools,
    }
