"""veRL: tools built as veRL builds them from a tool config, called as its ToolAgentLoop calls
them (create, execute with agent_data, release; a turn's calls at once), against a served
tvcache. BaseTool, OpenAIFunctionToolSchema and ToolResponse are veRL's own (frameworks.py)."""

import asyncio
import gc
import uuid

import pytest

from . import frameworks

frameworks.load_verl()

from verl.tools.base_tool import BaseTool  # noqa: E402
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse  # noqa: E402

from tvclient.integrations import verl as integration  # noqa: E402
from tvclient.integrations._asyncio import RolloutEnded  # noqa: E402
from tvclient.integrations.verl import TVCacheTool  # noqa: E402

# The wrapped tools keep their state per trajectory, by the agent loop's request id.
SESSIONS: dict[str, dict[str, str]] = {}
RAN: list = []


class AppendTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        notes = SESSIONS.setdefault(kwargs["agent_data"].request_id, {})
        RAN.append(("append", parameters["key"], parameters["text"], self.config.get("separator")))
        notes[parameters["key"]] = notes.get(parameters["key"], "") + parameters["text"]
        return ToolResponse(text=notes[parameters["key"]]), 0.0, {"length": len(notes[parameters["key"]])}


class ReadTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        RAN.append(("read", parameters["key"]))
        notes = SESSIONS.get(kwargs["agent_data"].request_id, {})
        return ToolResponse(text=notes.get(parameters["key"], "")), 0.0, {}


class AgentData:
    """What veRL's ToolAgentLoop passes its tools as `agent_data` (its AgentData's fields that
    tools read: request_id, tools_kwargs, extra_fields)."""

    def __init__(self, tools_kwargs):
        self.request_id = uuid.uuid4().hex
        self.tools_kwargs = tools_kwargs
        self.extra_fields = {}


def schema(name, *fields):
    return OpenAIFunctionToolSchema.model_validate({
        "type": "function",
        "function": {"name": name, "description": name, "parameters": {
            "type": "object", "properties": {f: {"type": "string"} for f in fields}, "required": list(fields)}},
    })


def tools(tvcache, **options):
    """As veRL's initialize_tools_from_config builds them: cls(config=..., tool_schema=...)."""
    own = {"type": "native", "tvcache_url": tvcache.url, "tvcache_token": tvcache.token,
           "tvcache_task_key": "doc", **options}
    return {
        "append": TVCacheTool(config={**own, "wrapped_class": f"{__name__}.AppendTool", "separator": "-"},
                              tool_schema=schema("append", "key", "text")),
        "read": TVCacheTool(config={**own, "wrapped_class": f"{__name__}.ReadTool", "tvcache_read_only": True},
                            tool_schema=schema("read", "key")),
    }


async def call_tool(tools, agent_data, name, **arguments):
    """ToolAgentLoop._call_tool for a BaseTool: create, execute with agent_data, release."""
    tool = tools[name]
    kwargs = agent_data.tools_kwargs.get(name, {})
    instance_id, _ = await tool.create(create_kwargs=kwargs.get("create_kwargs", {}))
    try:
        response, _, _ = await tool.execute(instance_id, arguments, agent_data=agent_data)
    finally:
        await tool.release(instance_id)
    return response.text


async def trajectory(tools, task_id, calls):
    agent_data = AgentData({"append": {"create_kwargs": {"doc": task_id}}})
    return [await call_tool(tools, agent_data, name, **args) for name, args in calls], agent_data


def append(text):
    return ("append", {"key": "a", "text": text})


READ = ("read", {"key": "a"})


@pytest.mark.django_db(transaction=True)
def test_trajectories_of_a_prompt_hit_each_other_and_stay_exact(tvcache, task_id):
    async def run():
        verl_tools = tools(tvcache)
        assert verl_tools["append"].name == "append" and verl_tools["append"].wrapped.config == {
            "type": "native", "separator": "-"}  # the wrapped tool's own config
        RAN.clear()
        first, _ = await trajectory(verl_tools, task_id, [append("x"), READ])
        assert first == ["x", "x"] and len(RAN) == 2
        second, _ = await trajectory(verl_tools, task_id, [append("x"), READ])
        assert second == first and len(RAN) == 2  # both tools' calls hit
        # The second append misses: the first is replayed into this trajectory's session, then
        # the read (another tool, the same history) sees both.
        third, _ = await trajectory(verl_tools, task_id, [append("x"), append("y"), READ])
        assert third == ["x", "xy", "xy"]
        fourth, _ = await trajectory(verl_tools, task_id, [READ])
        assert fourth == [""]

        # A turn's tool calls run at once (asyncio.gather): they run in the order they were made.
        agent_data = AgentData({"append": {"create_kwargs": {"doc": task_id}}})
        turn = await asyncio.gather(*(call_tool(verl_tools, agent_data, *append(t)[:1], **append(t)[1])
                                      for t in "123"))
        assert turn == ["1", "12", "123"]

    asyncio.run(run())
    assert tvcache.stats(task_id)["hits"] == 3


@pytest.mark.django_db(transaction=True)
def test_the_rollout_ends_with_the_agent_loop_or_its_ttl(tvcache, task_id):
    async def run():
        verl_tools = tools(tvcache, tvcache_rollout_ttl_s=0.3)
        _, agent_data = await trajectory(verl_tools, task_id, [append("x")])
        rollout = integration._by_agent_data[agent_data].rollout
        del agent_data  # the agent loop returns and drops its AgentData
        gc.collect()
        for _ in range(50):
            if rollout.executor is not None and rollout._closed:
                break
            await asyncio.sleep(0.02)
        assert rollout.ended and rollout._closed

        # A trajectory idle for longer than the TTL has ended: its next call runs nothing.
        agent_data = AgentData({"append": {"create_kwargs": {"doc": task_id}}})
        assert await call_tool(verl_tools, agent_data, *append("x")[:1], **append("x")[1]) == "x"
        await asyncio.sleep(0.6)
        with pytest.raises(RolloutEnded):
            await call_tool(verl_tools, agent_data, *READ[:1], **READ[1])

    asyncio.run(run())


class TallyTool(BaseTool):
    """A tool of the older agent loops: one instance per trajectory, state kept by instance."""

    tallies: dict[str, int] = {}

    async def create(self, instance_id=None, **kwargs):
        instance_id, response = await super().create(instance_id, **kwargs)
        TallyTool.tallies[instance_id] = kwargs["create_kwargs"]["start"]
        return instance_id, response

    async def execute(self, instance_id, parameters, **kwargs):
        RAN.append(("add", parameters["n"]))
        TallyTool.tallies[instance_id] += int(parameters["n"])
        return ToolResponse(text=str(TallyTool.tallies[instance_id])), 0.0, {}

    async def release(self, instance_id, **kwargs):
        del TallyTool.tallies[instance_id]


@pytest.mark.django_db(transaction=True)
def test_without_agent_data_the_instance_is_the_rollout(tvcache, task_id):
    tool = TVCacheTool(config={"type": "native", "wrapped_class": f"{__name__}.TallyTool",
                               "tvcache_url": tvcache.url, "tvcache_token": tvcache.token},
                       tool_schema=schema("add", "n"))

    async def trajectory(*numbers):
        instance_id, _ = await tool.create(create_kwargs={"start": 10, "doc": task_id})
        answers = [(await tool.execute(instance_id, {"n": n}))[0].text for n in numbers]
        await tool.release(instance_id)  # the trajectory's end
        return answers

    async def run():
        RAN.clear()
        assert await trajectory("1", "2") == ["11", "13"]
        assert await trajectory("1", "2") == ["11", "13"] and len(RAN) == 2
        # The miss replays "1" into an instance of its own, created with the same kwargs.
        assert await trajectory("1", "5") == ["11", "16"]
        assert RAN[2:] == [("add", "1"), ("add", "5")]
        assert TallyTool.tallies == {}  # every instance the wrapper made was released

    asyncio.run(run())
