"""SkyRL: environments made by skyrl_gym.make, as SkyRL's generator makes them, with the real
skyrl-gym package (BaseTextEnv, ToolGroup, the text2sql env) against a served tvcache."""

import json
import sqlite3
import uuid

import pytest
import skyrl_gym
from omegaconf import OmegaConf
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.tools.core import ToolGroup, tool

from tvclient.integrations.skyrl import tvcache_env


class NotesTools(ToolGroup):
    """Notes kept in Python; `executed` logs every call any copy ran."""

    executed: list = []

    def __init__(self):
        self.notes = {}
        super().__init__(name="NotesTools")

    @tool
    def append(self, key, text):
        NotesTools.executed.append(("append", key, text))
        self.notes[key] = self.notes.get(key, "") + text
        return self.notes[key]

    @tool
    def read(self, key):
        NotesTools.executed.append(("read", key))
        return self.notes.get(key, "")


class NotesEnv(BaseTextEnv):
    """Actions are JSON: [tool, [inputs...]]."""

    def __init__(self, env_config=None, extras={}):
        super().__init__()
        self.max_turns = extras.get("max_turns", 5)
        self.init_tool_groups([NotesTools()])

    def step(self, action):
        self.turns += 1
        name, tool_input = json.loads(action)
        output = self._execute_tool("NotesTools", name, tool_input)
        return BaseTextEnvStepOutput(observations=[{"role": "user", "content": output}], reward=0.0,
                                     done=self.turns >= self.max_turns, metadata={})


def registered(entry_point) -> str:
    env_id = f"tvcache-{uuid.uuid4().hex[:8]}"
    skyrl_gym.register(id=env_id, entry_point=entry_point)
    return env_id


def rollout(env_id, extras, actions, env_config=None):
    """What SkyRL's generator does with one trajectory: make, init, step, close."""
    env = skyrl_gym.make(env_id, env_config=env_config or OmegaConf.create({}), extras=dict(extras))
    env.init([{"role": "user", "content": "task"}])
    observations = [env.step(action)["observations"][0]["content"] for action in actions]
    env.close()
    return observations, env.executor


def act(tool_name, *inputs):
    return json.dumps([tool_name, list(inputs)])


@pytest.mark.django_db(transaction=True)
def test_rollouts_of_an_instance_hit_each_other_and_stay_exact(tvcache, task_id):
    env_id = registered(tvcache_env(NotesEnv, client=tvcache, read_only=("read",)))
    extras = {"instance_id": task_id, "max_turns": 5}
    NotesTools.executed.clear()
    first, ex1 = rollout(env_id, extras, [act("append", "a", "x"), act("read", "a")])
    assert first == ["x", "x"] and ex1.misses == 2

    ran = len(NotesTools.executed)
    second, ex2 = rollout(env_id, extras, [act("append", "a", "x"), act("read", "a")])
    assert second == first and ex2.hits == 2
    assert len(NotesTools.executed) == ran  # nothing ran

    # A second append after the cached one: the miss replays the first in a fresh copy of the
    # tool groups before it runs, and the read that follows sees both.
    third, ex3 = rollout(env_id, extras, [act("append", "a", "x"), act("append", "a", "y"), act("read", "a")])
    assert third == ["x", "xy", "xy"]
    assert (ex3.hits, ex3.misses, ex3.replayed) == (1, 2, 1)

    # Another branch never sees the first one's notes.
    fourth, _ = rollout(env_id, extras, [act("append", "a", "y"), act("read", "a")])
    assert fourth == ["y", "y"]
    assert tvcache.stats(task_id)["hits"] == 3


@pytest.mark.django_db(transaction=True)
def test_the_text2sql_env_is_cached_per_instance(tvcache, tmp_path):
    """SkyRL's own text2sql env and SQL tool group; its queries roll back, so `sql` is read-only."""
    for db_id, prices in (("shop", [10, 25]), ("shop2", [7])):
        database = tmp_path / "spider" / "database" / db_id / f"{db_id}.sqlite"
        database.parent.mkdir(parents=True)
        with sqlite3.connect(database) as connection:
            connection.execute("create table item (id integer primary key, price integer)")
            connection.executemany("insert into item (price) values (?)", [(p,) for p in prices])
    env_id = registered(tvcache_env("skyrl_gym.envs.sql.env:SQLEnv", client=tvcache, read_only=("sql",)))
    # No instance id in the extras: the task is a digest of them, the same for every repetition.
    extras = {"db_id": "shop", "data": "spider", "max_turns": 3,
              "reward_spec": {"ground_truth": "select sum(price) from item"}}
    config = OmegaConf.create({"db_path": str(tmp_path)})
    actions = ["<sql>select sum(price) from item</sql>", "<sql>select max(id) from item</sql>"]
    first, ex1 = rollout(env_id, extras, actions, config)
    second, ex2 = rollout(env_id, extras, actions, config)
    assert "35" in first[0] and "2" in first[1]
    assert second == first
    assert (ex1.misses, ex2.hits) == (2, 2)
    other, ex3 = rollout(env_id, {**extras, "db_id": "shop2"}, actions[:1], config)
    # Another instance is another task: the same query is not served the first shop's answer.
    assert ex3.task_id != ex1.task_id and ex3.misses == 1
    assert "7" in other[0] and "35" not in other[0]
