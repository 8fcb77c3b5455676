"""SkyRL driver: skyrl-gym environments run the way skyrl-train's generator runs them, without
tvcache and through it (a first pass, then repeat passes), a scripted policy in place of the model.

    TVCACHE_URL=... TVCACHE_TOKEN=... python -m lab.frameworks.skyrl_rollouts \
        [--scenarios notes,search,sql,values,order] [--passes 2] [--instances 2] [--workers 4] [--mode both]

skyrl-gym installs into the main venv, so this runs there (or anywhere skyrl-gym and tvclient
import); it imports no Django. Each trajectory is what `SkyRLGymGenerator.agent_loop` does with
one prompt: `skyrl_gym.make(env_class, env_config=..., extras=...)` (extras with `max_turns`),
`env.init(prompt)`, `env.step(action)` until done, `env.get_metrics()`, `env.close()`, the
environment calls in a thread pool (`max_env_workers`) and the trajectories of a batch gathered
on one event loop; after the batch, `skyrl_gym.metrics.aggregate_for_environment(env_id, metrics)`.

Scenarios:
- notes: a stateful tool group (Python state), trajectories that branch and share prefixes;
- search: skyrl-gym's SearchEnv (it overrides `_execute_tool`) and SearchToolGroup, against a
  retrieval server on loopback;
- sql: skyrl-gym's SQLEnv and SQL tool group over SQLite files;
- values: tools answering values that are not exact JSON (a tuple, a set, a dict with int keys),
  rendered with str();
- order: a tool answering a dict whose keys are not sorted, rendered with str() and json.dumps().

Prints one JSON document: per scenario and run ("uncached", "cached-1", ...), every trajectory's
init, step outputs and metrics (their repr), the batch's aggregate, the executors' counters (summed),
the tools' own call counter, wall and environment times; and whether each cached run is
identical to the uncached one.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import skyrl_gym
from omegaconf import OmegaConf
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.metrics import aggregate_for_environment
from skyrl_gym.tools.core import ToolGroup, tool

from tvclient.integrations import _shared
from tvclient.integrations.skyrl import tvcache_env

COUNTERS = ("hits", "misses", "executed", "replayed", "waited", "uncacheable", "record_failures")
PROMPT = [{"role": "system", "content": "You are a helpful assistant."}]


# -- notes: a stateful tool group ------------------------------------------------------------


class NotesTools(ToolGroup):
    """Notes kept in Python; `calls` counts every call any copy of any instance ran."""

    calls = 0
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.notes: dict[str, str] = {}
        super().__init__(name="NotesTools")

    @classmethod
    def _count(cls) -> None:
        with cls._lock:
            cls.calls += 1

    @tool
    def append(self, key: str, text: str) -> str:
        self._count()
        self.notes[key] = self.notes.get(key, "") + text
        return self.notes[key]

    @tool
    def read(self, key: str) -> str:
        self._count()
        return self.notes.get(key, "")

    @tool
    def keys(self) -> list[str]:
        self._count()
        return sorted(self.notes)


class NotesEnv(BaseTextEnv):
    """Actions are JSON `[tool, [inputs...]]`, or "<done/>"; the reward is whether the last read
    found `extras["target"]`."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] = {}) -> None:  # noqa: B006
        super().__init__()
        self.max_turns = extras.get("max_turns", 6)
        self.target = extras.get("target")
        self.last_read: Any = None
        self.writes = 0
        self.init_tool_groups([NotesTools()])

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        if action == "<done/>" or self.turns >= self.max_turns:
            reward = float(self.last_read == self.target)
            return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={"turns": self.turns})
        name, tool_input = json.loads(action)
        output = self._execute_tool("NotesTools", name, tool_input)
        if name == "read":
            self.last_read = output
        self.writes += name == "append"
        return BaseTextEnvStepOutput(
            observations=[{"role": "user", "content": json.dumps(output)}],
            reward=0.0,
            done=False,
            metadata={"tool": name, "input": tool_input},
        )

    def get_metrics(self) -> dict[str, Any]:
        return {"turns": self.turns, "writes": self.writes}

    @staticmethod
    def aggregate_metrics(metrics: list[dict[str, Any]]) -> dict[str, Any]:
        return {"trajectories": len(metrics), "most_writes": max((m["writes"] for m in metrics), default=0)}


def _act(name: str, *inputs: Any) -> str:
    return json.dumps([name, list(inputs)])


# -- values: results that are not exact JSON, and keys out of order ---------------------------


class ValuesTools(ToolGroup):
    calls = 0
    _lock = threading.Lock()

    def __init__(self) -> None:
        super().__init__(name="ValuesTools")

    @classmethod
    def _count(cls) -> None:
        with cls._lock:
            cls.calls += 1

    @tool
    def pair(self) -> tuple[int, str]:
        self._count()
        return (1, "a")

    @tool
    def tags(self) -> set[int]:
        self._count()
        return {3, 1, 2}

    @tool
    def by_id(self) -> dict[int, str]:
        self._count()
        return {2: "two", 1: "one"}

    @tool
    def layout(self) -> dict[str, Any]:
        self._count()
        return {"z": 1, "a": {"y": 2, "b": 3}}


class ValuesEnv(BaseTextEnv):
    """Actions name a ValuesTools tool; the observation is str() of its answer, and
    json.dumps() of it (keys in the order the tool gave) where it has a JSON form."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] = {}) -> None:  # noqa: B006
        super().__init__()
        self.max_turns = extras.get("max_turns", 6)
        self.init_tool_groups([ValuesTools()])

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        if action == "<done/>" or self.turns >= self.max_turns:
            return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})
        output = self._execute_tool("ValuesTools", action, [])
        try:
            text = f"{output!s}\n{json.dumps(output)}"
        except TypeError:
            text = str(output)
        return BaseTextEnvStepOutput(
            observations=[{"role": "user", "content": text}],
            reward=0.0,
            done=False,
            metadata={"type": type(output).__name__},
        )


# -- search: a retrieval server on loopback -------------------------------------------------

CORPUS = [
    "Paris\nParis is the capital and largest city of France.",
    "Lyon\nLyon is the third-largest city of France, on the Rhone.",
    "Everest\nMount Everest is Earth's highest mountain above sea level.",
    "K2\nK2 is the second-highest mountain on Earth.",
    "Rhone\nThe Rhone is a major river of France and Switzerland.",
]


class _Retrieval(BaseHTTPRequestHandler):
    """Search-R1's retrieval API (POST /retrieve): the documents sharing most words with the query."""

    protocol_version = "HTTP/1.1"  # keep-alive, as retrieval servers answer SearchToolGroup's pooled session
    disable_nagle_algorithm = True  # headers and body go out in two writes
    requests = 0
    _lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with _Retrieval._lock:
            _Retrieval.requests += 1
        words = set(body["query"].lower().split())
        scored = sorted(
            ((len(words & set(doc.lower().split())), -i, doc) for i, doc in enumerate(CORPUS)), reverse=True
        )
        hits = [{"document": {"contents": doc}, "score": score} for score, _, doc in scored[: body["topk"]]]
        payload = json.dumps({"result": [hits]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        pass


@contextmanager
def _retrieval_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Retrieval)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    finally:
        server.shutdown()
        server.server_close()


# -- sql: SQLite files as SkyRL's text2sql datasets lay them out ------------------------------


@contextmanager
def _spider_databases(count: int) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="skyrl-sql-") as root:
        for index in range(count):
            db_id = f"shop{index}"
            path = os.path.join(root, "spider", "database", db_id, f"{db_id}.sqlite")
            os.makedirs(os.path.dirname(path))
            with sqlite3.connect(path) as connection:
                connection.execute("create table item (id integer primary key, name text, price integer)")
                connection.executemany(
                    "insert into item (name, price) values (?, ?)",
                    [(f"item-{index}-{i}", 10 * (i + 1) + index) for i in range(3 + index)],
                )
            connection.close()
        yield root


# -- scenarios ----------------------------------------------------------------------------------


@dataclass
class Scenario:
    env_class: type[BaseTextEnv]
    read_only: tuple[str, ...]
    env_config: dict[str, Any]
    # Per instance: its extras, and the scripted responses of each of its repetitions.
    instances: list[tuple[dict[str, Any], list[list[str]]]]
    tool_calls: Callable[[], int] | None = None  # the tools' own counter, if they have one
    max_turns: int = 6
    notes: dict[str, Any] = field(default_factory=dict)


def _notes(count: int, nonce: str, stack: ExitStack) -> Scenario:
    scripts = [
        [_act("append", "a", "x"), _act("append", "a", "y"), _act("read", "a"), "<done/>"],
        [_act("append", "a", "x"), _act("read", "a"), _act("append", "b", "z"), _act("keys"), "<done/>"],
        [_act("append", "a", "x"), _act("append", "a", "y"), _act("read", "a"), "<done/>"],
    ]
    instances = [({"instance_id": f"notes-{nonce}-{i}", "target": "xy"}, scripts) for i in range(count)]
    return Scenario(NotesEnv, ("read", "keys"), {}, instances, tool_calls=lambda: NotesTools.calls)


def _search(count: int, nonce: str, stack: ExitStack) -> Scenario:
    url = stack.enter_context(_retrieval_server())
    questions = [("capital of france", "Paris"), ("highest mountain on earth", "Everest")]
    instances = []
    for i in range(count):
        query, answer = questions[i % len(questions)]
        scripts = [
            [f"<search>{query}</search>", "<search>river of france</search>", f"<answer>{answer}</answer>"],
            [f"<search>{query}</search>", "<answer>Lyon</answer>"],
        ]
        instances.append(
            ({"instance_id": f"search-{nonce}-{i}", "reward_spec": {"ground_truth": {"target": [answer]}}}, scripts)
        )
    config = {"search_url": url, "topk": 2, "timeout": 10, "log_requests": False}
    return Scenario(
        _class("skyrl_gym.envs.search.env", "SearchEnv"),
        ("search",),
        config,
        instances,
        tool_calls=lambda: _Retrieval.requests,
    )


def _sql(count: int, nonce: str, stack: ExitStack) -> Scenario:
    root = stack.enter_context(_spider_databases(count))
    scripts = [
        [
            "<think>size</think><sql>select count(*), sum(price) from item</sql>",
            "<think>names</think><sql>select name, price from item</sql>",
            "<think>oops</think><sql>select nope from item</sql>",
            "<think>done</think><solution>select sum(price) from item</solution>",
        ],
        [
            "<think>size</think><sql>select count(*), sum(price) from item</sql>",
            "<think>done</think><solution>select max(price) from item</solution>",
        ],
    ]
    # No instance id: the task is a digest of env_config and extras, as for a dataset without one.
    instances = [
        (
            {
                "db_id": f"shop{i}",
                "data": "spider",
                "run": nonce,
                "reward_spec": {"ground_truth": "select sum(price) from item"},
            },
            scripts,
        )
        for i in range(count)
    ]
    return Scenario(_class("skyrl_gym.envs.sql.env", "SQLEnv"), ("sql",), {"db_path": root}, instances)


def _values(count: int, nonce: str, stack: ExitStack) -> Scenario:
    scripts = [["pair", "tags", "by_id", "<done/>"]]
    instances = [({"instance_id": f"values-{nonce}-{i}"}, scripts) for i in range(count)]
    return Scenario(ValuesEnv, ("pair", "tags", "by_id"), {}, instances, tool_calls=lambda: ValuesTools.calls)


def _order(count: int, nonce: str, stack: ExitStack) -> Scenario:
    instances = [({"instance_id": f"order-{nonce}-{i}"}, [["layout", "<done/>"]]) for i in range(count)]
    return Scenario(ValuesEnv, ("layout",), {}, instances, tool_calls=lambda: ValuesTools.calls)


SCENARIOS: dict[str, Callable[[int, str, ExitStack], Scenario]] = {
    "notes": _notes,
    "search": _search,
    "sql": _sql,
    "values": _values,
    "order": _order,
}


def _class(module: str, name: str) -> type[BaseTextEnv]:
    return getattr(__import__(module, fromlist=[name]), name)


# -- the generator's loop --------------------------------------------------------------------


async def _trajectory(
    env_id: str, scenario: Scenario, extras: dict[str, Any], actions: list[str], pool: ThreadPoolExecutor
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    env_ms = 0.0

    async def in_pool(function: Callable[..., Any], *args: Any) -> Any:
        nonlocal env_ms
        started = time.perf_counter()
        try:
            return await loop.run_in_executor(pool, function, *args)
        finally:
            env_ms += (time.perf_counter() - started) * 1000

    extras = {**copy.deepcopy(extras), "max_turns": scenario.max_turns}
    env_config = OmegaConf.create(scenario.env_config)
    env = skyrl_gym.make(env_id, env_config=env_config, extras=extras)
    init = await in_pool(env.init, copy.deepcopy(PROMPT))
    steps = []
    for action in actions:  # the scripted model's response at each turn
        output = await in_pool(env.step, action)
        steps.append(repr(output))
        if output["done"]:
            break
    else:
        raise RuntimeError(f"{env_id}: the script ended before the environment was done")
    metrics = env.get_metrics()
    await in_pool(env.close)
    executor = getattr(env, "tvcache", None)
    counters = {name: getattr(executor, name, None) for name in COUNTERS} if executor is not None else None
    if executor is not None:
        counters["detached"] = executor.detached
        counters["task_id"] = executor.task_id
    return {
        "init": repr(init),
        "steps": steps,
        "metrics": metrics,
        "metrics_repr": repr(metrics),
        "env_ms": env_ms,
        "executor": counters,
    }


async def _batch(env_id: str, scenario: Scenario, workers: int) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="skyrl-gym-env-") as pool:
        return await asyncio.gather(
            *(
                _trajectory(env_id, scenario, extras, actions, pool)
                for extras, repetitions in scenario.instances
                for actions in repetitions
            )
        )


def _run(env_id: str, scenario: Scenario, workers: int) -> dict[str, Any]:
    before = scenario.tool_calls() if scenario.tool_calls else None
    started = time.perf_counter()
    trajectories = asyncio.run(_batch(env_id, scenario, workers))
    wall_ms = (time.perf_counter() - started) * 1000
    aggregate = aggregate_for_environment(env_id, [t["metrics"] for t in trajectories])
    counters: dict[str, Any] = {}
    for trajectory in trajectories:
        for name, value in (trajectory["executor"] or {}).items():
            if name != "task_id" and value is not None:
                counters[name] = counters.get(name, 0) + int(value)
    return {
        "trajectories": trajectories,
        "aggregate": repr(aggregate),
        "counters": counters,
        "tool_calls": scenario.tool_calls() - before if scenario.tool_calls else None,
        "wall_ms": round(wall_ms, 2),
        "env_ms": round(sum(t["env_ms"] for t in trajectories), 2),
    }


def _seen(run: dict[str, Any]) -> list[Any]:
    """What the trainer sees of a run: every trajectory's init, steps and metrics, and the aggregate."""
    return [[(t["init"], t["steps"], t["metrics_repr"]) for t in run["trajectories"]], run["aggregate"]]


def run(
    url: str,
    token: str,
    *,
    scenarios: list[str],
    passes: int = 2,
    instances: int = 2,
    workers: int = 4,
    mode: str = "both",
) -> dict[str, Any]:
    """Run each scenario uncached (unless mode is "cached") and through tvcache `passes` times
    (unless mode is "uncached"); the document the CLI prints."""
    client = _shared.shared_client(url, token)
    nonce = uuid.uuid4().hex[:10]
    document: dict[str, Any] = {
        "framework": "skyrl-gym",
        "version": _version(),
        "nonce": nonce,
        "passes": passes,
        "instances": instances,
        "workers": workers,
        "scenarios": {},
    }
    for name in scenarios:
        with ExitStack() as stack:
            scenario = SCENARIOS[name](instances, nonce, stack)
            plain_id, cached_id = f"{name}-{nonce}", f"{name}-{nonce}-tvcache"
            skyrl_gym.register(id=plain_id, entry_point=scenario.env_class)
            skyrl_gym.register(
                id=cached_id, entry_point=tvcache_env(scenario.env_class, client=client, read_only=scenario.read_only)
            )
            runs: dict[str, Any] = {}
            if mode in ("both", "uncached"):
                runs["uncached"] = _run(plain_id, scenario, workers)
            if mode in ("both", "cached"):
                for index in range(1, passes + 1):
                    runs[f"cached-{index}"] = _run(cached_id, scenario, workers)
            result: dict[str, Any] = {"runs": runs}
            if "uncached" in runs:
                result["identical"] = {
                    key: _seen(value) == _seen(runs["uncached"]) for key, value in runs.items() if key != "uncached"
                }
            document["scenarios"][name] = result
    return document


def _version() -> str:
    from importlib.metadata import version

    return version("skyrl-gym")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--passes", type=int, default=2, help="cached passes after the uncached run")
    parser.add_argument("--instances", type=int, default=2, help="prompts per scenario")
    parser.add_argument("--workers", type=int, default=4, help="environment threads (max_env_workers)")
    parser.add_argument("--mode", choices=("both", "uncached", "cached"), default="both")
    args = parser.parse_args(argv)
    url, token = os.environ.get("TVCACHE_URL"), os.environ.get("TVCACHE_TOKEN")
    if not url or not token:
        parser.error("set TVCACHE_URL and TVCACHE_TOKEN")
    document = run(
        url,
        token,
        scenarios=args.scenarios.split(","),
        passes=args.passes,
        instances=args.instances,
        workers=args.workers,
        mode=args.mode,
    )
    json.dump(document, sys.stdout, indent=1)
    print()
    _shared.close_clients()
    return 0


if __name__ == "__main__":
    sys.exit(main())
