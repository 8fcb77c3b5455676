"""SkyRL: a skyrl_gym `BaseTextEnv` whose tool calls go through tvcache.

    from skyrl_gym import register
    from tvclient.integrations.skyrl import tvcache_env

    register(id="text2sql", entry_point=tvcache_env("skyrl_gym.envs.sql.env:SQLEnv"))

The wrapped environment parses actions and builds observations as before; the calls it makes
through `BaseTextEnv._execute_tool` (tool group, tool, input) go through a `ToolCallExecutor`,
one per environment instance, which SkyRL creates per trajectory. The task is the instance:
`extras["instance_id"]` when the dataset has one, else a digest of the instance's extras (the
same for every repetition of a prompt). `close()` ends the rollout.

The sandbox is a copy of the environment's tool groups: Python state they keep is copied on a
fork. A tool that changes state outside the process (files, a database, a remote service) needs
`sandbox=` (a `ToolExecutionEnvironment` factory that starts and forks that state), or must be
declared in `read_only` only if it truly changes nothing.
"""

from __future__ import annotations

import copy
import importlib
import uuid
from typing import Any, Callable, Iterable, Mapping

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType

from ..client import TVCacheClient
from ..environment import ToolExecutionEnvironment
from ..executor import ToolCallExecutor
from ..results import Call, ToolResult
from . import _shared

TaskId = str | Callable[[Any, Mapping[str, Any]], str] | None


class ToolGroupEnvironment(ToolExecutionEnvironment):
    """A sandbox made of SkyRL tool groups: `start` copies the pristine groups, `fork` the
    current ones. Calls are `{"tool": name, "args": {"group": group name, "input": [...]}}`."""

    def __init__(self, pristine: list[Any], read_only: frozenset[str] = frozenset()) -> None:
        self._pristine = pristine
        self._read_only = read_only
        self.groups: dict[str, Any] = {}

    def start(self) -> None:
        self.groups = _copied(self._pristine)

    def execute(self, call: Call) -> ToolResult:
        group = self.groups[call["args"]["group"]]
        output = group.execute_tool(call["tool"], *call["args"]["input"])
        return {"output": _shared.plain(output)}

    def fork(self) -> ToolGroupEnvironment:
        twin = ToolGroupEnvironment(self._pristine, self._read_only)
        twin.groups = _copied(list(self.groups.values()))
        return twin

    def stop(self) -> None:
        self.groups = {}

    def mutates_state(self, call: Call) -> bool:
        return call["tool"] not in self._read_only


def _copied(groups: list[Any]) -> dict[str, Any]:
    copies = copy.deepcopy(groups)
    for group in copies:
        # A ToolGroup's registry holds closures over the instance it was built for: rebuild it,
        # or the copy's tools would run on the original.
        if hasattr(group, "_register_tools"):
            group._tool_registry = {}
            group._register_tools()
    return {group.name: group for group in copies}


class TVCacheTextEnv(BaseTextEnv):
    """`env` with its tool calls answered by tvcache; every other attribute is `env`'s own."""

    def __init__(
        self,
        env: BaseTextEnv,
        *,
        task_id: str,
        client: TVCacheClient | None = None,
        read_only: Iterable[str] = (),
        sandbox: Callable[[], ToolExecutionEnvironment] | None = None,
        task_env: Mapping[str, Any] | None = None,
        sandbox_budget: int | None = None,
        rollout_id: str | None = None,
        epoch: int | None = None,
    ) -> None:
        # No BaseTextEnv.__init__: turns, max_turns and tool groups are the wrapped env's.
        self.env = env
        self.task_id = task_id = _shared.task_slug(task_id)
        read_only = frozenset(read_only)
        client = client or _shared.shared_client()
        if sandbox is None:
            pristine = copy.deepcopy(list(env.tool_groups))  # before any call changes them

            def sandbox() -> ToolExecutionEnvironment:
                return ToolGroupEnvironment(pristine, read_only)

        _shared.ensure_task(
            client,
            task_id,
            env={"backend": "external", "skyrl_env": _class_path(type(env)), **(task_env or {})},
            tools=_shared.declared_tools(read_only),
            sandbox_budget=sandbox_budget,
        )
        self.executor = ToolCallExecutor(
            client,
            task_id,
            sandbox,
            rollout_id=rollout_id or uuid.uuid4().hex,
            epoch=epoch,
            snapshots=_shared.snapshots,
        )
        # The wrapped env's step() finds its tools through this method.
        env._execute_tool = self._execute_tool

    def _execute_tool(self, tool_group_name: str, tool_name: str, tool_input: Any) -> Any:
        if not any(group.name == tool_group_name for group in self.env.tool_groups):
            raise ValueError(f"ToolGroup '{tool_group_name}' not found.")
        call = {"tool": tool_name, "args": {"group": tool_group_name, "input": list(tool_input)}}
        return self.executor.execute(call)["output"]

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        return self.env.init(prompt)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        return self.env.step(action)

    def get_metrics(self) -> dict[str, Any]:
        return self.env.get_metrics()

    def close(self) -> None:
        """End the rollout (its record is sent, its sandbox stopped), then close the env."""
        try:
            self.executor.close()
        finally:
            self.env.close()

    def __getattr__(self, name: str) -> Any:
        if name == "env":  # not set yet: no recursion through self.env
            raise AttributeError(name)
        return getattr(self.env, name)


def tvcache_env(
    env_class: type[BaseTextEnv] | str,
    *,
    task_id: TaskId = None,
    client: TVCacheClient | None = None,
    **options: Any,
) -> Callable[..., TVCacheTextEnv]:
    """A skyrl_gym entry point that builds `env_class(env_config, extras)` and wraps it.

    `env_class` may be a class or "module:Class". `task_id` is a string, or a function of
    (env_config, extras); by default `extras["instance_id"]`, else a digest of the extras.
    `options` go to TVCacheTextEnv (read_only, sandbox, sandbox_budget, epoch, ...).
    """

    def make(env_config: Any = None, extras: Mapping[str, Any] | None = None, **kwargs: Any):
        cls = _resolve(env_class)
        extras = {} if extras is None else extras
        env = cls(env_config=env_config, extras=extras, **kwargs)
        task = _task_id(task_id, cls, env_config, extras)
        return TVCacheTextEnv(env, task_id=task, client=client, **options)

    return make


def _task_id(task_id: TaskId, cls: type, env_config: Any, extras: Mapping[str, Any]) -> str:
    if isinstance(task_id, str):
        return task_id
    if task_id is not None:
        return task_id(env_config, extras)
    if extras.get("instance_id") is not None:
        return str(extras["instance_id"])
    return f"{cls.__name__}-{_shared.digest([env_config, extras])[:20]}"


def _resolve(env_class: type[BaseTextEnv] | str) -> type[BaseTextEnv]:
    if not isinstance(env_class, str):
        return env_class
    module, _, name = env_class.partition(":")
    return getattr(importlib.import_module(module), name)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"
