"""SkyRL: skyrl_gym environments whose tool calls go through tvcache.

    import skyrl_gym
    from tvclient.integrations.skyrl import tvcache_env

    skyrl_gym.register(id="text2sql", entry_point=tvcache_env("skyrl_gym.envs.sql.env:SQLEnv", read_only=("sql",)))

`tvcache_env(EnvClass)` is a subclass of the environment class, named as it is. It is the entry
point: `skyrl_gym.make` builds it with the kwargs it would give the class, and everything
skyrl-gym and skyrl-train read off an entry point or an environment is the class's own
(`aggregate_metrics`, which `skyrl_gym.metrics.aggregate_for_environment` calls, `init`, `step`,
an overridden `_execute_tool`, `get_metrics`, `close`). What changes lies below them: every tool
group the environment installs (`init_tool_groups`, or `tool_groups` as its `__init__` leaves
them) answers `execute_tool` through a `ToolCallExecutor`, one per environment instance, which
SkyRL makes per trajectory; `close()` ends the rollout. An environment that post-processes tool
output (SearchEnv wraps it in `<information>`) does so on hits as on misses.

The recorded result is `{"output": <what the tool returned>}`, the tool's value unchanged; the
executor caches it only if it is exact JSON, and otherwise runs that call uncached. A hit returns
the value as JSON gives it back, which by that rule equals the live one, with the same types.
A tool's own exception reaches the environment as it would have; tvcache's failures do not (the
executor goes on uncached), and a replay that fails raises `ToolCallAborted`, which the
environment's `except Exception` does not turn into an observation.

The task is `task_id=` (a string, or a function of env_config and extras), else
`<EnvClass>-<extras["instance_id"]>-<digest of env_config>`, else `<EnvClass>-<digest of env_config and extras>` (the
same for every repetition of a prompt). The sandbox is a copy of the environment's tool groups,
taken at the rollout's first tool call; Python state they keep is copied on a fork. A tool that
changes state outside the process (files, a database, a remote service) needs `sandbox=` (a
`ToolExecutionEnvironment` factory that starts and forks that state), or must be declared in
`read_only` only if it truly changes nothing. The environment must read its tool groups' state
through tool calls only: on a hit no tool runs.
"""

from __future__ import annotations

import copy
import functools
import importlib
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from skyrl_gym.envs.base_text_env import BaseTextEnv
from skyrl_gym.tools.core import ToolGroup

from ..client import TaskSpec, TVCacheClient
from ..environment import ToolExecutionEnvironment
from ..executor import ReplayFailed, ToolCallExecutor
from ..results import Call, ToolResult
from . import _shared

TaskId = str | Callable[[Any, Mapping[str, Any]], str] | None
Sandbox = Callable[[], ToolExecutionEnvironment]


class ToolCallAborted(BaseException):
    """tvcache could not answer a tool call as the tool would have: a replay failed (a call
    that ran when it was recorded raised or timed out when replayed). The service failing is
    not such a case: the executor goes on uncached.

    A BaseException, not an Exception: skyrl-gym's environments catch Exception around their
    tool calls and show its text to the model as the observation, which without tvcache would
    have been the tool's answer. The trajectory stops instead.
    """


class ToolGroupEnvironment(ToolExecutionEnvironment):
    """A sandbox made of SkyRL tool groups: `start` copies the pristine groups, `fork` the
    current ones. Calls are `{"tool": name, "args": {"group": group name, "input": [...]}}`,
    with `"kwargs": {...}` when the environment passed keyword arguments."""

    def __init__(self, pristine: list[ToolGroup], read_only: frozenset[str] = frozenset()) -> None:
        self._pristine = pristine
        self._read_only = read_only
        self.groups: dict[str, ToolGroup] = {}

    def start(self) -> None:
        self.groups = _copied(self._pristine)

    def execute(self, call: Call) -> ToolResult:
        args = call["args"]
        group = self.groups[args["group"]]
        return {"output": group.execute_tool(call["tool"], *args["input"], **args.get("kwargs", {}))}

    def fork(self) -> ToolGroupEnvironment:
        twin = ToolGroupEnvironment(self._pristine, self._read_only)
        twin.groups = _copied(list(self.groups.values()))
        return twin

    def stop(self) -> None:
        self.groups = {}

    def mutates_state(self, call: Call) -> bool:
        return call["tool"] not in self._read_only


def _copied(groups: list[ToolGroup]) -> dict[str, ToolGroup]:
    copies = copy.deepcopy(groups)
    for group in copies:
        # A ToolGroup's registry holds closures over the instance it was built for: rebuild it,
        # or the copy's tools would run on the original.
        group._tool_registry = {}
        group._register_tools()
    return {group.name: group for group in copies}


@dataclass(frozen=True)
class _Options:
    task_id: TaskId = None
    client: TVCacheClient | None = None
    read_only: frozenset[str] = frozenset()
    sandbox: Sandbox | None = None
    task_env: Mapping[str, Any] = field(default_factory=dict)
    sandbox_budget: int | None = None
    epoch: int | None = None


def tool_call(group: str, name: str, *args: Any, **kwargs: Any) -> Call:
    """The call tvcache keys a tool group's `execute_tool(name, *args, **kwargs)` by: what a branch
    of the environment's executor (`env.tvcache.branch(n)`) executes for that tool, answering
    `{"output": <the tool's value>}`."""
    call_args: dict[str, Any] = {"group": group, "input": list(args)}
    if kwargs:
        call_args["kwargs"] = kwargs
    return {"tool": name, "args": call_args}


class _Rollout:
    """One environment instance's tool calls: its tool groups answer through the executor."""

    def __init__(self, options: _Options, env_class: type, env_config: Any, extras: Mapping[str, Any]) -> None:
        self._options = options
        client = options.client or _shared.shared_client()
        self.task_id = _shared.task_slug(_task_id(options.task_id, env_class, env_config, extras))
        task = TaskSpec(
            env={
                "backend": "external",
                "skyrl_env": _class_path(env_class),
                # A task named by instance id must not serve another configuration's answers.
                "skyrl_env_config": _shared.digest(env_config),
                **options.task_env,
            },
            tools=_shared.declared_tools(options.read_only),
            sandbox_budget=options.sandbox_budget,
        )
        self.executor = ToolCallExecutor(
            client,
            self.task_id,
            self._sandbox,
            rollout_id=uuid.uuid4().hex,
            epoch=options.epoch,
            snapshots=_shared.snapshots,
            task=task,
        )
        self._groups: list[ToolGroup] = []
        self._pristine: list[ToolGroup] | None = None

    def attach(self, groups: Iterable[ToolGroup]) -> None:
        """Answer the environment's tool groups (`groups`, which replace any installed before)
        through the executor."""
        groups = list(groups)
        if [id(group) for group in groups] == [id(group) for group in self._groups]:
            return
        if self._pristine is not None:
            raise RuntimeError(
                "the environment installed tool groups after the rollout's first tool call: "
                "tvcache's sandbox starts from the groups as they were at that call"
            )
        names = [group.name for group in groups]
        if len(set(names)) < len(names):
            raise RuntimeError(f"tool groups {names} share a name: tvcache's sandbox finds them by name")
        self.release()
        for group in groups:
            if "execute_tool" in vars(group):
                raise RuntimeError(
                    f"tool group {group.name!r} already answers for another environment: "
                    "tvcache needs each environment instance to have tool groups of its own"
                )
            group.execute_tool = functools.partial(self.execute_tool, group)
            self._groups.append(group)

    def release(self) -> None:
        """The groups answer as they did before `attach`."""
        for group in self._groups:
            vars(group).pop("execute_tool", None)
        self._groups = []

    def execute_tool(self, group: ToolGroup, name: str, *args: Any, **kwargs: Any) -> Any:
        if group.get_tool(name) is None and type(group).execute_tool is ToolGroup.execute_tool:
            return ToolGroup.execute_tool(group, name, *args, **kwargs)  # its ValueError, as without tvcache
        if self._pristine is None and self._options.sandbox is None:
            self._pristine = self._copy_groups()
        try:
            return self.executor.execute(tool_call(group.name, name, *args, **kwargs))["output"]
        except ReplayFailed as exc:  # any other error is the tool's own, as the environment would see it
            raise ToolCallAborted(f"tvcache could not answer {group.name}.{name} as the tool would: {exc!r}") from exc

    def close(self) -> None:
        """End the rollout: its records are sent, its sandbox stopped. The groups still answer
        through the executor, so that a call made after close() sees the rollout's state."""
        self.executor.close()

    def _sandbox(self) -> ToolExecutionEnvironment:
        if self._options.sandbox is not None:
            return self._options.sandbox()
        assert self._pristine is not None  # copied at the first call, before any lookup
        return ToolGroupEnvironment(self._pristine, self._options.read_only)

    def _copy_groups(self) -> list[ToolGroup]:
        patches = [vars(group).pop("execute_tool") for group in self._groups]
        try:
            return copy.deepcopy(self._groups)
        finally:
            for group, patch in zip(self._groups, patches, strict=True):
                group.execute_tool = patch


class TVCacheEnv:
    """What `tvcache_env` mixes into an environment class. `tvcache` is the instance's
    ToolCallExecutor (its counters: hits, misses, executed, ...)."""

    _tvcache_options: ClassVar[_Options]
    tvcache_wrapped: ClassVar[type[BaseTextEnv]]
    tvcache: ToolCallExecutor

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        env_config = kwargs["env_config"] if "env_config" in kwargs else (args[0] if args else None)
        extras = kwargs["extras"] if "extras" in kwargs else (args[1] if len(args) > 1 else None)
        rollout = self._tvcache_rollout = _Rollout(
            self._tvcache_options, self.tvcache_wrapped, env_config, extras or {}
        )
        self.tvcache = rollout.executor
        try:
            super().__init__(*args, **kwargs)
            rollout.attach(getattr(self, "tool_groups", ()))
        except BaseException:
            rollout.release()
            rollout.close()
            raise

    def init_tool_groups(self, tool_groups: list[ToolGroup] = []) -> None:  # noqa: B006 - BaseTextEnv's signature
        super().init_tool_groups(tool_groups)  # type: ignore[misc]
        self._tvcache_rollout.attach(self.tool_groups)  # type: ignore[attr-defined]

    def close(self) -> None:
        """End the rollout, then close the environment as its class does."""
        try:
            self._tvcache_rollout.close()
        finally:
            super().close()  # type: ignore[misc]


def tvcache_env(
    env_class: type[BaseTextEnv] | str,
    *,
    task_id: TaskId = None,
    client: TVCacheClient | None = None,
    read_only: Iterable[str] = (),
    sandbox: Sandbox | None = None,
    task_env: Mapping[str, Any] | None = None,
    sandbox_budget: int | None = None,
    epoch: int | None = None,
) -> type[BaseTextEnv]:
    """A skyrl_gym entry point: `env_class` (a class or "module:Class") with its tool calls
    going through tvcache.

    `task_id`: a string, or a function of (env_config, extras); by default the class name and
    `extras["instance_id"]`, else a digest of env_config and extras. `read_only`: the tools that
    change nothing. `sandbox`: a `ToolExecutionEnvironment` factory for tools whose state lies
    outside the tool groups. `task_env`: more of the task's environment spec (what changes it
    changes the task's fingerprint, which drops its graph).
    """
    cls = _resolve(env_class)
    if issubclass(cls, TVCacheEnv):
        raise TypeError(f"{cls.__qualname__} goes through tvcache already")
    options = _Options(
        task_id=task_id,
        client=client,
        read_only=frozenset(read_only),
        sandbox=sandbox,
        task_env=dict(task_env or {}),
        sandbox_budget=sandbox_budget,
        epoch=epoch,
    )
    # Named as the class is: an environment that shows its own name (str(env)) shows the same.
    namespace = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "_tvcache_options": options,
        "tvcache_wrapped": cls,
    }
    return type(cls.__name__, (TVCacheEnv, cls), namespace)


def _task_id(task_id: TaskId, cls: type, env_config: Any, extras: Mapping[str, Any]) -> str:
    if isinstance(task_id, str):
        return task_id
    if task_id is not None:
        return task_id(env_config, extras)
    if extras.get("instance_id") is not None:  # one task per instance and configuration
        return f"{cls.__name__}-{extras['instance_id']}-{_shared.digest(env_config)[:8]}"
    return f"{cls.__name__}-{_shared.digest([env_config, extras])[:20]}"


def _resolve(env_class: type[BaseTextEnv] | str) -> type[BaseTextEnv]:
    if not isinstance(env_class, str):
        return env_class
    module, _, name = env_class.partition(":")
    return getattr(importlib.import_module(module), name)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"
