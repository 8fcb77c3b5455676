"""SkyRL with the released skyrl-gym, driven through its own path as skyrl-train's generator
drives it (`skyrl_gym.make`, `init`, `step` until done, `get_metrics`, `close`, then
`skyrl_gym.metrics.aggregate_for_environment`), against a served tvcache.

The driver `lab/frameworks/skyrl_rollouts.py` runs each scenario uncached, then through tvcache
twice; skyrl-gym installs into the main venv, so it runs in this process. What the trainer sees
(every init, step output and metrics dict, by repr, and the batch's aggregate) must be the same
in all three runs.
"""

import ast
import json
import re
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import skyrl_gym
from omegaconf import OmegaConf
from skyrl_gym.envs.base_text_env import BaseTextEnvStepOutput
from skyrl_gym.envs.sql.env import SQLEnv
from skyrl_gym.metrics import aggregate_for_environment
from skyrl_gym.tools.core import tool

from accounts.services import tokens
from lab.frameworks import skyrl_rollouts
from lab.frameworks.skyrl_rollouts import NotesEnv, NotesTools
from tvclient import TVCacheClient
from tvclient.integrations.skyrl import ToolCallAborted, tvcache_env

DOC = Path(__file__).resolve().parents[3] / "docs" / "integrations" / "skyrl.md"


def seen(run):
    """What the trainer sees of a run (skyrl_rollouts._seen, restated: the test's own reading)."""
    return [[(t["init"], t["steps"], t["metrics_repr"]) for t in run["trajectories"]], run["aggregate"]]


def steps_of(run):
    return [step for trajectory in run["trajectories"] for step in trajectory["steps"]]


def contents(run):
    """The observations' text, read back from the step outputs' repr."""
    return [o["content"] for step in steps_of(run) for o in ast.literal_eval(step)["observations"]]


@pytest.fixture
def drive(tvcache):
    def drive(*scenarios, **options):
        return skyrl_rollouts.run(tvcache.url, tvcache.token, scenarios=list(scenarios), **options)

    return drive


@pytest.mark.django_db(transaction=True)
def test_trajectories_are_exact_and_the_repeat_pass_runs_no_tool(drive):
    document = drive("notes", "search", "sql", passes=2, instances=2, workers=4)
    for name, result in document["scenarios"].items():
        runs = result["runs"]
        uncached, first, repeat = runs["uncached"], runs["cached-1"], runs["cached-2"]
        assert seen(first) == seen(uncached), name
        assert seen(repeat) == seen(uncached), name
        assert first["counters"]["misses"] > 0, name
        # Every call of the repeat pass is a hit: nothing runs, nothing is replayed.
        calls = first["counters"]["hits"] + first["counters"]["misses"]
        assert repeat["counters"]["hits"] == calls, name
        assert [repeat["counters"][key] for key in ("misses", "executed", "replayed")] == [0, 0, 0], name
        assert repeat["counters"]["detached"] == 0 and repeat["counters"]["record_failures"] == 0
        if uncached["tool_calls"] is not None:  # the tools' own counter
            assert uncached["tool_calls"] == calls and repeat["tool_calls"] == 0, name

    notes = document["scenarios"]["notes"]["runs"]
    # The entry point is the class's subclass: aggregate_for_environment found NotesEnv's own
    # aggregate_metrics (the default would average), and its metrics are NotesEnv's.
    assert {run["aggregate"] for run in notes.values()} == {"{'trajectories': 6, 'most_writes': 2}"}
    assert '"xy"' in "".join(steps_of(notes["cached-2"]))

    search = document["scenarios"]["search"]["runs"]
    # SearchEnv's own _execute_tool wraps the tool's output, on hits as without tvcache.
    assert contents(search["cached-2"])[0].startswith('\n<information>{"result": "Doc 1: Paris')
    assert {run["aggregate"] for run in search.values()} == {"{}"}  # BaseTextEnv's default on no metrics

    sql = document["scenarios"]["sql"]["runs"]
    text = "".join(steps_of(sql["cached-2"]))
    assert "Error executing SQL: no such column: nope" in text and "item-1-3" in text
    rewards = [re.findall(r"'reward': ([-\d.]+)", step) for step in steps_of(sql["uncached"])]
    assert ["1.0"] in rewards and ["0.0"] in rewards
    # No instance id: each database's extras are a task of their own, the same for all repetitions.
    tasks = {t["executor"]["task_id"] for t in sql["cached-1"]["trajectories"]}
    assert len(tasks) == 2 and all(task.startswith("SQLEnv-") for task in tasks)


@pytest.mark.django_db(transaction=True)
def test_results_without_exact_json_run_uncached_and_are_passed_on_as_they_are(drive):
    runs = drive("values", passes=2, instances=1)["scenarios"]["values"]["runs"]
    assert seen(runs["cached-1"]) == seen(runs["uncached"])
    assert seen(runs["cached-2"]) == seen(runs["uncached"])
    assert contents(runs["cached-2"]) == [
        "(1, 'a')\n[1, \"a\"]",
        "{1, 2, 3}",
        '{2: \'two\', 1: \'one\'}\n{"2": "two", "1": "one"}',
    ]
    # None of the three has an exact JSON form: each runs every pass, uncached, and is counted.
    for key in ("cached-1", "cached-2"):
        assert runs[key]["counters"]["uncacheable"] == 3
        assert runs[key]["counters"]["hits"] == 0 and runs[key]["tool_calls"] == 3
        assert runs[key]["counters"]["detached"] == 0  # read-only: the rollout stays on the graph


@pytest.mark.django_db(transaction=True)
def test_a_result_keeps_its_key_order(drive):
    runs = drive("order", passes=2, instances=1)["scenarios"]["order"]["runs"]
    assert seen(runs["cached-2"]) == seen(runs["uncached"])
    assert runs["cached-2"]["counters"]["hits"] == 1 and runs["cached-2"]["tool_calls"] == 0
    assert contents(runs["cached-2"]) == ["""{'z': 1, 'a': {'y': 2, 'b': 3}}\n{"z": 1, "a": {"y": 2, "b": 3}}"""]


def registered(entry_point) -> str:
    env_id = f"tvcache-{uuid.uuid4().hex[:8]}"
    skyrl_gym.register(id=env_id, entry_point=entry_point)
    return env_id


def rollout(env_id, extras, actions, env_config=None):
    """One trajectory as SkyRL's generator runs it; the step outputs' observations and the env."""
    env = skyrl_gym.make(env_id, env_config=env_config or OmegaConf.create({}), extras=dict(extras))
    env.init([{"role": "user", "content": "task"}])
    observations = [[o["content"] for o in env.step(action)["observations"]] for action in actions]
    env.close()
    return observations, env


def act(tool_name, *inputs):
    return json.dumps([tool_name, list(inputs)])


@pytest.mark.django_db(transaction=True)
def test_a_branch_replays_what_it_lacks_and_never_sees_another_branch(tvcache, task_id):
    entry_point = tvcache_env(NotesEnv, client=tvcache, read_only=("read", "keys"))
    assert issubclass(entry_point, NotesEnv) and entry_point.__name__ == "NotesEnv"
    env_id = registered(entry_point)
    extras = {"instance_id": task_id, "max_turns": 9}
    first, env = rollout(env_id, extras, [act("append", "a", "x"), act("read", "a")])
    assert first == [['"x"'], ['"x"']] and env.tvcache.misses == 2
    assert env.tvcache.task_id.startswith(f"NotesEnv-{task_id}-")  # and the configuration's digest

    # A second append after the cached one: the miss replays the first in a fresh copy of the
    # tool groups before it runs, and the read that follows sees both.
    ran = NotesTools.calls
    third, env = rollout(env_id, extras, [act("append", "a", "x"), act("append", "a", "y"), act("read", "a")])
    assert third == [['"x"'], ['"xy"'], ['"xy"']]
    assert (env.tvcache.hits, env.tvcache.misses, env.tvcache.replayed) == (1, 2, 1)
    assert NotesTools.calls - ran == 3  # the replayed append, the new one, the read after it

    # Another branch never sees the first one's notes; the environment's own groups never ran.
    fourth, env = rollout(env_id, extras, [act("append", "a", "y"), act("read", "a")])
    assert fourth == [['"y"'], ['"y"']]
    assert env.tool_groups[0].notes == {}


class FailingNotesEnv(NotesEnv):
    """Renders a tool's error as the observation, as skyrl-gym's own environments do."""

    def step(self, action):
        try:
            return super().step(action)
        except Exception as exc:
            return BaseTextEnvStepOutput(
                observations=[{"role": "user", "content": f"error: {exc!r}"}], reward=0.0, done=False, metadata={}
            )


@pytest.mark.django_db(transaction=True)
def test_a_tool_error_is_the_observation_it_would_have_been(tvcache, task_id):
    script = [act("append", "a", "x"), act("append"), act("append", "a", "y"), act("read", "a")]
    extras = {"instance_id": task_id, "max_turns": 9}
    plain, _ = rollout(registered(FailingNotesEnv), extras, script)
    assert "missing 2 required positional arguments" in plain[1][0]
    cached_id = registered(tvcache_env(FailingNotesEnv, client=tvcache, read_only=("read", "keys")))
    for _ in range(2):
        cached, env = rollout(cached_id, extras, script)
        assert cached == plain
        assert env.tvcache.detached  # the call raised: the rest ran in the rollout's own sandbox


@pytest.mark.django_db(transaction=True)
def test_a_refusal_by_the_service_runs_the_call_uncached(tvcache, tmp_path):
    """SQLEnv shows any Exception its tool call raises to the model: tvcache's errors must never
    get there. A revoked token: the rollout goes on uncached, with the tool's own answer."""
    database = tmp_path / "spider" / "database" / "shop" / "shop.sqlite"
    database.parent.mkdir(parents=True)
    with sqlite3.connect(database) as connection:
        connection.execute("create table item (price integer)")
        connection.execute("insert into item values (42)")
    connection.close()
    extras = {"db_id": "shop", "data": "spider", "reward_spec": {"ground_truth": "select 1"}}
    config = OmegaConf.create({"db_path": str(tmp_path)})
    action = "<think>t</think><sql>select price from item</sql>"
    plain = skyrl_gym.make(registered(SQLEnv), env_config=config, extras=dict(extras))
    expected = repr(plain.step(action))
    name = f"refused-{uuid.uuid4().hex[:8]}"
    with TVCacheClient(tvcache.url, tokens.token_create(name=name)) as client:
        env = skyrl_gym.make(
            registered(tvcache_env(SQLEnv, client=client, read_only=("sql",))), env_config=config, extras=dict(extras)
        )
        env.init([{"role": "user", "content": "task"}])
        tokens.token_revoke(name=name)
        tokens._verified.clear()  # refused at once rather than within TOKEN_CACHE_TTL_S
        assert repr(env.step(action)) == expected
        assert env.tvcache.offline and env.tvcache.executed == 1
        env.close()


class FlakyNotes(NotesTools):
    broken = False

    @tool
    def append(self, key, text):
        if FlakyNotes.broken and text == "x":
            raise OSError("the disk is gone")
        return super().append(key, text)


class FlakyNotesEnv(FailingNotesEnv):
    def __init__(self, env_config=None, extras={}):  # noqa: B006 - BaseTextEnv's signature
        super().__init__(env_config, extras)
        self.init_tool_groups([FlakyNotes()])


@pytest.mark.django_db(transaction=True)
def test_a_replay_that_fails_stops_the_trajectory(tvcache, task_id):
    """Without tvcache the second append would have answered "xy": no observation can say it."""
    env_id = registered(tvcache_env(FlakyNotesEnv, client=tvcache, read_only=("read", "keys")))
    extras = {"instance_id": task_id, "max_turns": 9}
    assert rollout(env_id, extras, [act("append", "a", "x")])[0] == [['"x"']]
    FlakyNotes.broken = True
    try:
        env = skyrl_gym.make(env_id, env_config=OmegaConf.create({}), extras=dict(extras))
        assert env.step(act("append", "a", "x"))["observations"] == [{"role": "user", "content": '"x"'}]  # a hit
        with pytest.raises(ToolCallAborted) as raised:
            env.step(act("append", "a", "y"))  # replays the first append, which raises now
        assert isinstance(raised.value.__cause__.__cause__, OSError)  # ReplayFailed, from the tool's error
        env.close()
    finally:
        FlakyNotes.broken = False


def test_aggregate_for_environment_finds_the_wrapped_class_metrics():
    env_id = registered(tvcache_env("skyrl_gym.envs.gsm8k.multi_turn_env:GSM8kMultiTurnEnv"))
    assert aggregate_for_environment(env_id, [{"steps": 2}, {"steps": 4}]) == {"avg_steps": 3.0}


@pytest.mark.django_db(transaction=True)
def test_the_documented_example_runs(tvcache, tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert len(blocks) == 1
    environment = {"TVCACHE_URL": tvcache.url, "TVCACHE_TOKEN": tvcache.token, "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", blocks[0]], env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.django_db(transaction=True)
def test_the_documented_tree_search_example_runs(tvcache, tmp_path):
    """docs/design/tree-search.md's SkyRL example: a trajectory branched, and its epoch exported."""
    page = (Path(__file__).resolve().parents[3] / "docs" / "design" / "tree-search.md").read_text()
    section = page.split("## A runnable example: tree search in SkyRL", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    environment = {"TVCACHE_URL": tvcache.url, "TVCACHE_TOKEN": tvcache.token, "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", block], env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("4 trajectories, sharing ratio")
