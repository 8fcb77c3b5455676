"""veRL: a `BaseTool` that runs another tool's calls through tvcache.

In the tool config, the tool's class moves to `wrapped_class` and `class_name` names this one;
a `@function_tool` function is named by `wrapped_function` (docs/integrations/verl.md):

    tools:
      - class_name: tvclient.integrations.verl.TVCacheTool
        config:
          type: native
          wrapped_class: my_tools.SearchTool      # was class_name
        tool_schema: {...}                        # unchanged

veRL's ToolAgentLoop creates, executes and releases a tool instance per call and passes its
`AgentData` as `agent_data`: a rollout is that trajectory. All wrapped tools of a trajectory share
one rollout, so a write by one tool and a read by another are in one history. The rollout ends
when the agent loop lets go of its `AgentData`, or after `tvcache_rollout_ttl_s` idle seconds
(default 600). The task is a digest of the sample's `tools_kwargs`, or the `create_kwargs` value
named by `tvcache_task_key`. Without `agent_data` (a loop that keeps an instance for a whole
trajectory), the instance is the rollout and `release` ends it.

What a call leaves on the framework's side is part of its result, so that a hit leaves it as the
live call would: the changes the call made to `agent_data.extra_fields` (applied to the
trajectory's own `extra_fields`), and, for a tool that defines `calc_reward`, the reward of its
instance right after the call (what `TVCacheTool.calc_reward` answers). The wrapped tool itself
runs in the rollout's sandbox: on an `AgentData` of its own whose `extra_fields` has the
sandbox's history in it, never the trajectory's, so that replays add nothing to the trajectory.
A wrapped tool that changes anything else of the `AgentData`, or a read-only one that writes
`extra_fields`, raises `SideEffectNotKept`.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import json
import time
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.function_tool import (
    FUNCTION_TOOL_REGISTRY,
    FunctionTool,
    load_function_tools_from_path,
    normalize_function_tool_return,
)
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.rollout_trace import rollout_trace_op

from ..client import TaskSpec, TVCacheClient
from ..executor import ToolCallExecutor
from ..results import Call, ToolResult, inexact_json
from . import _shared
from ._asyncio import AsyncRollout, LoopEnvironment

OWN_KEYS = (
    "wrapped_class",
    "wrapped_function",
    "tvcache_read_only",
    "tvcache_task_key",
    "tvcache_rollout_ttl_s",
    "tvcache_url",
    "tvcache_token",
    "tvcache_epoch",
)
DEFAULT_TTL_S = 600.0

# The wrapped tools of this process by name, and the trajectories in flight.
_tools: dict[str, TVCacheTool] = {}
_by_agent_data: weakref.WeakKeyDictionary[Any, _Trajectory] = weakref.WeakKeyDictionary()
_by_instance: dict[str, _Trajectory] = {}


class SideEffectNotKept(BaseException):
    """A wrapped tool changed something of the trajectory that a cached call cannot give back.

    A BaseException, so that the agent loop does not turn it into the tool's answer (it would be
    a silently different observation): the rollout stops, and the message says what to change.
    """


@dataclass(frozen=True)
class _Raised:
    """An exception the wrapped tool's calc_reward raised, kept to be raised when it is asked
    for (not JSON: a call carrying one runs uncached)."""

    error: Exception


@dataclass
class _Instance:
    """One instance of TVCacheTool: its create kwargs and what its last call left."""

    create_kwargs: dict[str, Any]
    executed: bool = False
    reward: tuple[dict[str, Any], Any] | None = None  # (calc_reward kwargs, its answer)


# -- the wrapped tool: a BaseTool or a FunctionTool ----------------------------------------


class _WrappedClass:
    """A BaseTool, run as ToolAgentLoop runs it: create, execute, release."""

    def __init__(self, tool: BaseTool) -> None:
        self.tool = tool
        self.path = f"{type(tool).__module__}.{type(tool).__qualname__}"
        self.scores = type(tool).calc_reward is not BaseTool.calc_reward

    async def run(self, sandbox: _Sandbox, name: str, args: dict[str, Any], kwargs: dict[str, Any]) -> ToolResult:
        instance_id = sandbox.kept.get(name) or await sandbox.create(name, self.tool)
        try:
            response, reward, metrics = await self.tool.execute(instance_id, args, **kwargs)
            result: ToolResult = {"response": _response_fields(response), "reward": reward, "metrics": metrics}
            if self.scores:  # the instance's reward now, as a calc_reward after this call reads it
                result["calc_reward"] = await self._score(instance_id, sandbox.calc_reward_kwargs(name))
        finally:
            if name not in sandbox.kept:
                await self.tool.release(instance_id)
        return result

    async def _score(self, instance_id: str, kwargs: dict[str, Any]) -> Any:
        try:
            return await self.tool.calc_reward(instance_id, **kwargs)
        except Exception as exc:  # raised when asked for, as the live instance would
            return _Raised(exc)


class _WrappedFunction:
    """A FunctionTool, run as ToolAgentLoop runs it: call, then normalize its return."""

    def __init__(self, tool: FunctionTool) -> None:
        self.tool = tool
        self.path = f"{tool.fn.__module__}.{tool.fn.__qualname__}"
        self.scores = False

    async def run(self, sandbox: _Sandbox, name: str, args: dict[str, Any], kwargs: dict[str, Any]) -> ToolResult:
        response, reward, metrics = normalize_function_tool_return(await self.tool.call(args))
        return {"response": _response_fields(response), "reward": reward, "metrics": metrics}


def _response_fields(response: ToolResponse) -> Any:
    """The response as the fields it was given (a ToolResponse built from them is equal to it,
    down to `model_fields_set`); another type is left as it is, and its call runs uncached."""
    if type(response) is not ToolResponse:
        return response
    return {name: getattr(response, name) for name in ToolResponse.model_fields if name in response.model_fields_set}


def _response(fields: Any) -> ToolResponse:
    return fields if isinstance(fields, ToolResponse) else ToolResponse(**fields)


# -- extra_fields: what a call changed, and the same change made elsewhere --------------------


def _same(before: Any, after: Any) -> bool:
    if inexact_json(before) is None and inexact_json(after) is None:
        return json.dumps(before) == json.dumps(after)  # types and key order included
    try:
        return type(before) is type(after) and bool(before == after)
    except Exception:  # noqa: BLE001 - an array's ambiguous truth: take it as changed
        return False


def _fields_change(before: dict[Any, Any], after: dict[Any, Any]) -> dict[str, list[Any]]:
    """What turns `before` (a deep copy taken before the call) into `after`, key order included:
    values changed in place, keys removed, and keys (re)inserted, in their order at the end."""
    position = {key: index for index, key in enumerate(before)}
    keys, last, split = list(after), -1, len(after)
    for index, key in enumerate(keys):  # the keys left in place come first, in their old order
        if key not in position or position[key] < last:
            split = index
            break
        last = position[key]
    inserted = keys[split:]
    return {
        "set": [[key, copy.deepcopy(after[key])] for key in keys[:split] if not _same(before[key], after[key])],
        "pop": [key for key in before if key not in after or key in inserted],
        "add": [[key, copy.deepcopy(after[key])] for key in inserted],
    }


def _apply_change(change: Mapping[str, list[Any]] | None, fields: dict[Any, Any]) -> None:
    if not change:
        return
    if "replace" in change:  # the tool gave agent_data a new extra_fields
        fields.clear()
        fields.update((key, value) for key, value in change["replace"])
        return
    for key, value in change["set"]:
        fields[key] = value
    for key in change["pop"]:
        fields.pop(key, None)
    for key, value in change["add"]:
        fields[key] = value


def _changed(change: Mapping[str, list[Any]] | None) -> bool:
    return bool(change) and any(change.values())


# -- the rollout: its sandbox and its trajectory ------------------------------------------


class _Sandbox(LoopEnvironment):
    """A trajectory's tools, called as veRL's agent loop calls them: an instance per call, or
    (a trajectory without agent data, whose instance is the rollout) one kept per tool.

    The wrapped tools see an AgentData of the sandbox's own: the trajectory's, but for its
    `extra_fields`, which start as the trajectory's did and change only by the calls run here.
    """

    def __init__(self, trajectory: _Trajectory) -> None:
        assert trajectory.rollout.loop is not None  # set by the call that opens the executor
        super().__init__(trajectory.rollout.loop)
        self._trajectory = trajectory
        self.kept: dict[str, str] = {}  # by tool name, in a trajectory without agent data
        self._fields = copy.deepcopy(trajectory.initial_fields)
        self._agent_data: Any = None

    def mutates_state(self, call: Call) -> bool:
        return not _tools[call["tool"]].read_only

    def execute_observed(self, call: Call) -> tuple[ToolResult, bool | None]:
        # A read-only tool's call changes nothing here (its extra_fields are checked below),
        # even when its result cannot be cached.
        return self.execute(call), (False if not self.mutates_state(call) else None)

    async def aexecute(self, call: Call) -> ToolResult:
        name = call["tool"]
        tool = _tools[name]
        kwargs = self._trajectory.kwargs()
        agent_data = kwargs.get("agent_data")
        if agent_data is None:
            result = await tool.wrapped.run(self, name, call["args"], kwargs)
            return {**result, "extra_fields": None}
        view = self._view(agent_data)
        attributes, before = dict(vars(view)), copy.deepcopy(self._fields)
        result = await tool.wrapped.run(self, name, call["args"], {**kwargs, "agent_data": view})
        change = self._change(name, view, attributes, before)
        if tool.read_only and _changed(change):
            raise SideEffectNotKept(
                f"{name} is declared tvcache_read_only but changed agent_data.extra_fields: a tool "
                "that keeps session data there changes state (remove tvcache_read_only)"
            )
        return {**result, "extra_fields": change}

    def _view(self, agent_data: Any) -> Any:
        """The wrapped tools' AgentData: one object for the sandbox's life, as the trajectory's
        is one for its own (a tool may key state by it), with the trajectory's attributes as
        they are now, but for extra_fields."""
        if self._agent_data is None:
            self._agent_data = copy.copy(agent_data)
        else:
            vars(self._agent_data).clear()
            vars(self._agent_data).update(vars(agent_data))
        self._agent_data.extra_fields = self._fields
        return self._agent_data

    def _change(self, name: str, view: Any, attributes: dict[str, Any], before: dict[Any, Any]) -> dict[str, list[Any]]:
        now = vars(view)
        others = [
            key
            for key in now.keys() | attributes.keys()
            if key != "extra_fields" and now.get(key, view) is not attributes.get(key, view)
        ]
        if others:
            raise SideEffectNotKept(
                f"{name} set agent_data.{', '.join(sorted(others))}: a cached call keeps only what a "
                "tool changes in agent_data.extra_fields (keep tool session data there)"
            )
        if view.extra_fields is not self._fields:  # replaced, not changed
            self._fields = view.extra_fields
            return {"replace": [[key, copy.deepcopy(value)] for key, value in self._fields.items()]}
        return _fields_change(before, self._fields)

    def calc_reward_kwargs(self, name: str) -> dict[str, Any]:
        """The kwargs of a calc_reward after `name`'s calls: the sample's `calc_reward_kwargs`."""
        tools_kwargs = self._trajectory.tools_kwargs.get(name) or {}
        return dict(tools_kwargs.get("calc_reward_kwargs") or {})

    async def create(self, name: str, tool: BaseTool) -> str:
        create_kwargs = self._trajectory.create_kwargs.get(name, {})
        instance_id, _ = await tool.create(create_kwargs=create_kwargs)
        if self._trajectory.keeps_instances:
            self.kept[name] = instance_id
        return instance_id

    async def astop(self) -> None:
        kept, self.kept = self.kept, {}
        for name, instance_id in kept.items():
            wrapped = _tools[name].wrapped
            assert isinstance(wrapped, _WrappedClass)  # only those have instances
            await wrapped.tool.release(instance_id)


class _Trajectory:
    """One rollout: its executor, what its calls need (create and execute kwargs), and the
    order in which their changes reach the trajectory's extra_fields."""

    def __init__(
        self, tool: TVCacheTool, task_id: str, tools_kwargs: Any, ttl_s: float, agent_data: Any = None
    ) -> None:
        self.keeps_instances = agent_data is None
        task_id = _shared.task_slug(task_id)
        self.tools_kwargs: Mapping[str, Any] = tools_kwargs if isinstance(tools_kwargs, Mapping) else {}
        self.create_kwargs: dict[str, Any] = {}
        fields = getattr(agent_data, "extra_fields", None)
        self.initial_fields: dict[Any, Any] = copy.deepcopy(fields) if isinstance(fields, dict) else {}
        # What the agent loop passed to execute(), but its AgentData only by weak reference:
        # the trajectory must not keep alive the object whose end ends it.
        self.execute_kwargs: dict[str, Any] = {}
        self.agent_data: weakref.ref[Any] | None = None
        self.ttl_s = ttl_s
        self.last_used = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._issued = 0
        self._delivered: dict[int, Any] = {}
        self._applied = 0
        tools = dict(sorted(_tools.items()))
        spec = TaskSpec(
            env={
                "backend": "external",
                "verl_tools": {name: t.wrapped.path for name, t in tools.items()},
                "tools_kwargs": _shared.digest(tools_kwargs),
            },
            tools=_shared.declared_tools(frozenset(n for n, t in tools.items() if t.read_only)),
            sandbox_budget=0,
        )
        client, epoch = tool.client, tool.epoch

        def open_executor(rollout: AsyncRollout) -> ToolCallExecutor:
            return ToolCallExecutor(
                client,
                task_id,
                lambda: _Sandbox(self),
                rollout_id=uuid.uuid4().hex,
                epoch=epoch,
                snapshots=_shared.snapshots,
                task=spec,
            )

        self.rollout = AsyncRollout(open_executor)

    def note_call(self, kwargs: dict[str, Any]) -> int:
        """Keep what the call passed; its number, in the order the calls were made."""
        self.execute_kwargs = {key: value for key, value in kwargs.items() if key != "agent_data"}
        agent_data = kwargs.get("agent_data")
        self.agent_data = weakref.ref(agent_data) if agent_data is not None else None
        self._touch()
        number, self._issued = self._issued, self._issued + 1
        return number

    def deliver(self, number: int, change: Mapping[str, list[Any]] | None, fields: dict[Any, Any] | None) -> None:
        """Make call `number`'s change to `fields` once the calls before it made theirs: a
        turn's calls (asyncio.gather) change extra_fields in the order they were made."""
        self._delivered[number] = (change, fields)
        while self._applied in self._delivered:
            change, fields = self._delivered.pop(self._applied)
            if fields is not None:
                _apply_change(change, fields)
            self._applied += 1

    def kwargs(self) -> dict[str, Any]:
        agent_data = self.agent_data() if self.agent_data is not None else None
        if agent_data is None:
            return dict(self.execute_kwargs)
        return {**self.execute_kwargs, "agent_data": agent_data}

    def _touch(self) -> None:
        """Restart the idle clock; the rollout ends `ttl_s` after its last call."""
        self.last_used = time.monotonic()
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.ttl_s, self._expire)

    def _expire(self) -> None:
        idle = time.monotonic() - self.last_used
        if idle >= self.ttl_s:
            self.rollout.end_soon()
        else:
            self._timer = asyncio.get_running_loop().call_later(self.ttl_s - idle, self._expire)


# -- the tool veRL builds from the tool config ---------------------------------------------


class TVCacheTool(BaseTool):
    """The tool named by `config["wrapped_class"]` (a BaseTool) or `config["wrapped_function"]`
    (a `@function_tool`), its calls answered by tvcache."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None) -> None:
        wrapped_config = {key: value for key, value in config.items() if key not in OWN_KEYS}
        self.wrapped = _wrapped(config, wrapped_config, tool_schema)
        if isinstance(self.wrapped, _WrappedClass):
            tool_schema = self.wrapped.tool.tool_schema
        else:
            tool_schema = tool_schema or self.wrapped.tool.tool_schema
        super().__init__(config, tool_schema)
        self.read_only = bool(config.get("tvcache_read_only", False))
        self.task_key: str | None = config.get("tvcache_task_key")
        self.ttl_s = float(config.get("tvcache_rollout_ttl_s", DEFAULT_TTL_S))
        self.epoch: int | None = config.get("tvcache_epoch")
        self.client: TVCacheClient = _shared.shared_client(config.get("tvcache_url"), config.get("tvcache_token"))
        self._instances: dict[str, _Instance] = {}
        _tools[self.name] = self

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """An instance for one call; the wrapped tool's own instance is made when it runs."""
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = _Instance(dict(kwargs.get("create_kwargs") or {}))
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        agent_data = kwargs.get("agent_data")
        instance = self._instances.setdefault(instance_id, _Instance({}))
        if agent_data is not None and instance.executed:
            raise ValueError(
                f"{self.name}: tvcache runs one call per instance when the agent loop passes "
                "agent_data (as ToolAgentLoop does); create an instance per call"
            )
        trajectory = self._trajectory(instance_id, agent_data)
        trajectory.create_kwargs[self.name] = instance.create_kwargs
        number = trajectory.note_call(kwargs)
        fields = getattr(agent_data, "extra_fields", None) if agent_data is not None else None
        result: ToolResult | None = None
        try:
            result = await trajectory.rollout.execute({"tool": self.name, "args": parameters})
        finally:
            trajectory.deliver(
                number, result.get("extra_fields") if result else None, fields if isinstance(fields, dict) else None
            )
        instance.executed = True
        if "calc_reward" in result:
            instance.reward = (self._calc_reward_kwargs(trajectory), result["calc_reward"])
        return _response(result["response"]), result["reward"], result["metrics"]

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The wrapped tool's reward for this instance: as its last call left it (evaluated right
        after that call, with the sample's `calc_reward_kwargs`), or of a fresh instance."""
        instance = self._instances.get(instance_id) or _Instance({})
        if instance.reward is None:
            return await self._fresh_reward(instance, kwargs)
        expected, reward = instance.reward
        if kwargs != expected:
            raise ValueError(
                f"{self.name}: calc_reward was evaluated after the call with {expected!r} "
                f"(tools_kwargs[{self.name!r}]['calc_reward_kwargs']), not {kwargs!r}"
            )
        if isinstance(reward, _Raised):
            raise reward.error
        return reward

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
        trajectory = _by_instance.pop(instance_id, None)
        if trajectory is not None:
            await trajectory.rollout.end()

    async def _fresh_reward(self, instance: _Instance, kwargs: dict[str, Any]) -> Any:
        if not isinstance(self.wrapped, _WrappedClass) or not self.wrapped.scores:
            return await super().calc_reward("", **kwargs)
        tool = self.wrapped.tool
        own, _ = await tool.create(create_kwargs=instance.create_kwargs)
        try:
            return await tool.calc_reward(own, **kwargs)
        finally:
            await tool.release(own)

    def _calc_reward_kwargs(self, trajectory: _Trajectory) -> dict[str, Any]:
        if trajectory.keeps_instances:
            return {}
        return dict((trajectory.tools_kwargs.get(self.name) or {}).get("calc_reward_kwargs") or {})

    def _trajectory(self, instance_id: str, agent_data: Any) -> _Trajectory:
        if agent_data is None:
            trajectory = _by_instance.get(instance_id)
            if trajectory is None:
                create_kwargs = self._instances[instance_id].create_kwargs
                tools_kwargs = {self.name: {"create_kwargs": create_kwargs}}
                trajectory = _by_instance[instance_id] = _Trajectory(
                    self, self._task_id(tools_kwargs), tools_kwargs, self.ttl_s
                )
            return trajectory
        trajectory = _by_agent_data.get(agent_data)
        if trajectory is None:
            tools_kwargs = getattr(agent_data, "tools_kwargs", None) or {}
            trajectory = _Trajectory(self, self._task_id(tools_kwargs), tools_kwargs, self.ttl_s, agent_data)
            _by_agent_data[agent_data] = trajectory
            # The agent loop's end: it drops its AgentData once the trajectory is done.
            weakref.finalize(agent_data, trajectory.rollout.end_soon)
        return trajectory

    def _task_id(self, tools_kwargs: Mapping[str, Any]) -> str:
        """The sample's task, whichever tool the trajectory calls first."""
        if self.task_key is None:
            return f"verl-{_shared.digest(tools_kwargs)[:20]}"
        for name in sorted(tools_kwargs):
            create_kwargs = (tools_kwargs[name] or {}).get("create_kwargs") or {}
            if self.task_key in create_kwargs:
                return str(create_kwargs[self.task_key])
        raise ValueError(f"tvcache_task_key {self.task_key!r} is in no tool's create_kwargs")


# -- configuration -------------------------------------------------------------------------


def _wrapped(
    config: Mapping[str, Any], wrapped_config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None
) -> _WrappedClass | _WrappedFunction:
    """The tool the config names, checked here so that a wrong config fails when veRL builds
    the tools, not at the first call."""
    class_path, function_path = config.get("wrapped_class"), config.get("wrapped_function")
    if (class_path is None) == (function_path is None):
        raise ValueError(
            "TVCacheTool needs one of config.wrapped_class (a BaseTool) and config.wrapped_function (a @function_tool)"
        )
    if function_path is not None:
        return _WrappedFunction(_function_tool(str(function_path)))
    if ".py:" in str(class_path):
        raise TypeError(f"{class_path} is a function tool's file: name it with wrapped_function")
    target = _import(str(class_path))
    if isinstance(target, FunctionTool) or callable(target) and _registered(target):
        raise TypeError(f"{class_path} is a function tool: name it with wrapped_function")
    if not (isinstance(target, type) and issubclass(target, BaseTool)):
        raise TypeError(f"wrapped_class {class_path} is not a verl BaseTool")
    return _WrappedClass(target(config=wrapped_config, tool_schema=tool_schema))


def _function_tool(target: str) -> FunctionTool:
    """The FunctionTool `target` names: `path/to/file.py:name` (the file loaded as veRL loads a
    function_tool_path) or `package.module.function`; `name` is the tool's or the function's."""
    location, _, name = target.rpartition(":")
    if location.endswith(".py"):
        found = [tool for tool in load_function_tools_from_path(location) if name in (tool.name, tool.fn.__name__)]
    else:
        function = _import(target)
        found = [function] if isinstance(function, FunctionTool) else _registered(function)
    if len(found) != 1:
        raise ValueError(f"wrapped_function {target} names no @function_tool")
    return found[0]


def _registered(function: Any) -> list[FunctionTool]:
    return [tool for tool in FUNCTION_TOOL_REGISTRY.values() if tool.fn is function]


def _import(path: str) -> Any:
    module, _, name = path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), name)
