"""veRL: a `BaseTool` that runs another `BaseTool`'s calls through tvcache.

In the tool config, the tool's class moves to `wrapped_class` and `class_name` names this one:

    tools:
      - class_name: tvclient.integrations.verl.TVCacheTool
        config:
          type: native
          wrapped_class: my_tools.SandboxTool   # was class_name
          tvcache_read_only: false              # true only if the tool changes nothing
        tool_schema: {...}                      # unchanged

veRL's agent loop creates and releases a tool instance around every call, so a rollout is the
agent loop's trajectory: its `AgentData` (passed to `execute` as `agent_data`, with the
`request_id` and `extra_fields` the wrapped tool keys its state by). All wrapped tools of a
trajectory share one rollout, so a write by one tool and a read by another are in one history.
The rollout ends when the agent loop lets go of its `AgentData`, or after
`tvcache_rollout_ttl_s` idle seconds (default 600). The task is a digest of the trajectory's
`tools_kwargs` (the same for every sample of a prompt), or the `create_kwargs` value named by
`tvcache_task_key`. Without `agent_data` (older agent loops, which keep an instance for a
whole trajectory), the instance is the rollout, the wrapped tool keeps one instance of its own
for it, and `release` ends it.

Cached responses are text: a tool answering images or video raises. The wrapped tool's output
must depend only on its create kwargs, the rollout's earlier calls and its arguments.
"""

from __future__ import annotations

import asyncio
import importlib
import time
import uuid
import weakref
from typing import Any, Mapping

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.rollout_trace import rollout_trace_op

from ..client import TVCacheClient
from ..executor import ToolCallExecutor
from ..results import Call, ToolResult
from . import _shared
from ._asyncio import AsyncRollout, LoopEnvironment

OWN_KEYS = ("wrapped_class", "tvcache_read_only", "tvcache_task_key", "tvcache_rollout_ttl_s",
            "tvcache_url", "tvcache_token", "tvcache_epoch")
DEFAULT_TTL_S = 600.0

# The wrapped tools of this process by name, and the trajectories in flight.
_tools: dict[str, TVCacheTool] = {}
_by_agent_data: weakref.WeakKeyDictionary[Any, _Trajectory] = weakref.WeakKeyDictionary()
_by_instance: dict[str, _Trajectory] = {}


class _Sandbox(LoopEnvironment):
    """A trajectory's tools, called as veRL's agent loop calls them: an instance per call, or
    (a trajectory without agent data, whose instance is the rollout) one kept per tool."""

    def __init__(self, trajectory: _Trajectory) -> None:
        assert trajectory.rollout.loop is not None  # set by the call that opens the executor
        super().__init__(trajectory.rollout.loop)
        self._trajectory = trajectory
        self._kept: dict[str, str] = {}

    async def aexecute(self, call: Call) -> ToolResult:
        name = call["tool"]
        tool = _tools[name].wrapped
        instance_id = self._kept.get(name) or await self._create(name)
        try:
            response, reward, metrics = await tool.execute(
                instance_id, call["args"], **self._trajectory.kwargs()
            )
        finally:
            if not self._trajectory.keeps_instances:
                await tool.release(instance_id)
        if response.image or response.video:
            raise TypeError(f"tvcache caches text tool responses; {name} answered media")
        return {"text": response.text, "reward": float(reward), "metrics": _shared.plain(metrics)}

    async def astop(self) -> None:
        kept, self._kept = self._kept, {}
        for name, instance_id in kept.items():
            await _tools[name].wrapped.release(instance_id)

    async def _create(self, name: str) -> str:
        create_kwargs = self._trajectory.create_kwargs.get(name, {})
        instance_id, _ = await _tools[name].wrapped.create(create_kwargs=create_kwargs)
        if self._trajectory.keeps_instances:
            self._kept[name] = instance_id
        return instance_id


class _Trajectory:
    """One rollout: its executor and what its calls need (create and execute kwargs)."""

    def __init__(self, tool: TVCacheTool, task_id: str, tools_kwargs: Any, ttl_s: float,
                 keeps_instances: bool = False) -> None:
        self.keeps_instances = keeps_instances
        task_id = _shared.task_slug(task_id)
        self.create_kwargs: dict[str, Any] = {}
        # What the agent loop passed to execute(), but its AgentData only by weak reference:
        # the trajectory must not keep alive the object whose end ends it.
        self.execute_kwargs: dict[str, Any] = {}
        self.agent_data: weakref.ref[Any] | None = None
        self.ttl_s = ttl_s
        self.last_used = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        client, epoch = tool.client, tool.epoch

        def open_executor(rollout: AsyncRollout) -> ToolCallExecutor:
            tools = dict(sorted(_tools.items()))
            _shared.ensure_task(
                client,
                task_id,
                env={
                    "backend": "external",
                    "verl_tools": {name: _class_path(type(t.wrapped)) for name, t in tools.items()},
                    "tools_kwargs": _shared.digest(tools_kwargs),
                },
                tools=_shared.declared_tools(frozenset(n for n, t in tools.items() if t.read_only)),
                sandbox_budget=0,
            )
            return ToolCallExecutor(client, task_id, lambda: _Sandbox(self),
                                    rollout_id=uuid.uuid4().hex, epoch=epoch,
                                    snapshots=_shared.snapshots)

        self.rollout = AsyncRollout(open_executor)

    def note_call(self, kwargs: dict[str, Any]) -> None:
        self.execute_kwargs = {key: value for key, value in kwargs.items() if key != "agent_data"}
        agent_data = kwargs.get("agent_data")
        self.agent_data = weakref.ref(agent_data) if agent_data is not None else None
        self._touch()

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


class TVCacheTool(BaseTool):
    """The tool named by `config["wrapped_class"]`, its calls answered by tvcache."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None) -> None:
        wrapped_class = _import(config["wrapped_class"])
        wrapped_config = {key: value for key, value in config.items() if key not in OWN_KEYS}
        self.wrapped: BaseTool = wrapped_class(config=wrapped_config, tool_schema=tool_schema)
        super().__init__(config, self.wrapped.tool_schema)
        self.read_only = bool(config.get("tvcache_read_only", False))
        self.task_key: str | None = config.get("tvcache_task_key")
        self.ttl_s = float(config.get("tvcache_rollout_ttl_s", DEFAULT_TTL_S))
        self.epoch: int | None = config.get("tvcache_epoch")
        self.client: TVCacheClient = _shared.shared_client(
            config.get("tvcache_url"), config.get("tvcache_token")
        )
        self._instances: dict[str, dict[str, Any]] = {}
        _tools[self.name] = self

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """An instance for one call; the wrapped tool's own instance is made when it runs."""
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = dict(kwargs.get("create_kwargs") or {})
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        trajectory = self._trajectory(instance_id, kwargs.get("agent_data"))
        trajectory.create_kwargs[self.name] = self._instances.get(instance_id, {})
        trajectory.note_call(kwargs)
        result = await trajectory.rollout.execute({"tool": self.name, "args": parameters})
        return ToolResponse(text=result["text"]), result["reward"], result["metrics"]

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        own, _ = await self.wrapped.create(create_kwargs=self._instances.get(instance_id, {}))
        try:
            return await self.wrapped.calc_reward(own, **kwargs)
        finally:
            await self.wrapped.release(own)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
        trajectory = _by_instance.pop(instance_id, None)
        if trajectory is not None:
            await trajectory.rollout.end()

    def _trajectory(self, instance_id: str, agent_data: Any) -> _Trajectory:
        if agent_data is None:
            trajectory = _by_instance.get(instance_id)
            if trajectory is None:
                create_kwargs = self._instances.get(instance_id, {})
                tools_kwargs = {self.name: {"create_kwargs": create_kwargs}}
                trajectory = _by_instance[instance_id] = _Trajectory(
                    self, self._task_id(tools_kwargs), tools_kwargs, self.ttl_s, keeps_instances=True
                )
            return trajectory
        trajectory = _by_agent_data.get(agent_data)
        if trajectory is None:
            tools_kwargs = getattr(agent_data, "tools_kwargs", None) or {}
            trajectory = _Trajectory(self, self._task_id(tools_kwargs), tools_kwargs, self.ttl_s)
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


def _import(path: str) -> type[BaseTool]:
    module, _, name = path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), name)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
