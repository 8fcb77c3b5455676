"""Tinker (tinker-cookbook): sandboxes, tools and env groups whose calls go through tvcache.

    from tvclient.integrations.tinker import TVCacheEnvGroupBuilder, tvcache_sandbox_factory

    builder = TVCacheEnvGroupBuilder(
        HarborEnvGroupBuilder(task, ..., sandbox_factory=tvcache_sandbox_factory(default_sandbox_factory)),
        task_id=task.task_name,
    )

An `EnvGroupBuilder` group is a task: sandboxes and tools made while the wrapped builder makes
its envs belong to it. Each `TVCacheSandbox` is a rollout: `run_command`, `read_file` and
`write_file` go through a `ToolCallExecutor`, and the real sandbox is only created when a call
misses (a rollout whose calls all hit never starts one). `TVCacheTool` does the same for a
tool's `run`; pass `rollout=` to put a tool in a sandbox's history when both touch one state
(the tool may then use that TVCacheSandbox: while the tool runs live, its sandbox calls go
straight to the real sandbox, as part of the tool's call). A rollout ends when its env's step
returns `episode_done`, when the group's `cleanup()` runs, or at the sandbox's own `cleanup()`.

Results are recorded as the framework's own values and rebuilt on a hit: a `SandboxResult` or a
`ToolResult` equal to the one the live call returned. A value with no exact JSON form (a tuple,
an image, NaN) is left as it is, and the executor runs that call uncached (`inexact_json`).

A tool call's key is its arguments and whether it came with a call id. A tool message's
`tool_call_id` that is the call's own id is recorded as such, and a hit answers it with the id
of the call it answers; any other value of it, and the rest of the result, is served as recorded.

A command that ran for its whole timeout, or that the sandbox answers with exit code -1 (what
the cookbook's sandboxes answer when the backend failed), is reported to the executor as
`timed_out`: the sandbox's state after it is unknown.
"""

from __future__ import annotations

import base64
import contextvars
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tinker_cookbook.rl.types import Env, EnvGroupBuilder, StepResult
from tinker_cookbook.sandbox.sandbox_interface import SandboxInterface, SandboxResult
from tinker_cookbook.tool_use.types import Tool, ToolInput, ToolResult

from ..client import TaskSpec, TVCacheClient
from ..executor import ToolCallExecutor
from ..results import Call
from ..results import ToolResult as RecordedResult
from . import _shared
from ._asyncio import AsyncRollout, LoopEnvironment

SandboxMaker = Callable[[], Awaitable[SandboxInterface]]
SANDBOX_CALLS = frozenset({"run_command", "read_file", "write_file"})
READ_ONLY_SANDBOX_CALLS = frozenset({"read_file"})
FAILED_EXIT_CODE = -1


@dataclass
class _Group:
    """The task of one env group, and the rollouts made for it."""

    task_id: str
    client: TVCacheClient
    task_env: Mapping[str, Any]
    epoch: int | None
    rollouts: list[TVCacheRollout] = field(default_factory=list)


_group: contextvars.ContextVar[_Group | None] = contextvars.ContextVar("tvcache_group", default=None)
# The rollouts an env's step has called, so that its episode_done ends them.
_episode: contextvars.ContextVar[set[TVCacheRollout] | None] = contextvars.ContextVar("tvcache_episode", default=None)
# The rollout whose tool is running live: that tool's sandbox calls go to the real sandbox.
_running: contextvars.ContextVar[TVCacheRollout | None] = contextvars.ContextVar("tvcache_tinker_running", default=None)


@dataclass(eq=False)
class _ToolCallInFlight:
    """A tool call made and not yet answered, with the call id its live run is given."""

    call: Call
    call_id: str | None


class _Sandbox(LoopEnvironment):
    """The rollout's real sandbox (made by its factory on the first miss) and its tools."""

    def __init__(self, rollout: TVCacheRollout) -> None:
        assert rollout.calls.loop is not None  # set by the call that opens the executor
        super().__init__(rollout.calls.loop)
        self._rollout = rollout
        self._sandbox: SandboxInterface | None = None

    def execute_observed(self, call: Call) -> tuple[RecordedResult, bool | None]:
        # A call declared read-only changes nothing: the service files it so (and the executor
        # does not leave the graph when such a call's result cannot be cached).
        return self.execute(call), False if not self.mutates_state(call) else None

    def mutates_state(self, call: Call) -> bool:
        return call["tool"] not in self._rollout.read_only

    async def astart(self) -> None:
        if self._rollout.make_sandbox is not None:
            self._sandbox = await self._rollout.make_sandbox()
            self._rollout.live_sandbox = self._sandbox

    async def aexecute(self, call: Call) -> RecordedResult:
        name, args = call["tool"], call["args"]
        if name not in SANDBOX_CALLS:
            return await self._run_tool(name, call)
        if self._sandbox is None:
            raise RuntimeError(f"{name}: this rollout has no sandbox factory")
        started = time.monotonic()
        if name == "run_command":
            done = await self._sandbox.run_command(**args)
        elif name == "read_file":
            done = await self._sandbox.read_file(**args)
        else:
            content = base64.b64decode(args["content_b64"]) if "content_b64" in args else args["content"]
            done = await self._sandbox.write_file(
                args["path"], content, executable=args["executable"], timeout=args["timeout"]
            )
        timed_out = time.monotonic() - started >= args["timeout"] or done.exit_code == FAILED_EXIT_CODE
        return {
            "stdout": done.stdout,
            "stderr": done.stderr,
            "exit_code": done.exit_code,
            "metrics": done.metrics,
            "timed_out": timed_out,
        }

    async def _run_tool(self, name: str, call: Call) -> RecordedResult:
        call_id = self._rollout.live_call_id(call)
        token = _running.set(self._rollout)
        try:
            result = await self._rollout.tools[name].run(
                ToolInput(arguments=call["args"]["arguments"], call_id=call_id)
            )
        finally:
            _running.reset(token)
        return _recorded_tool_result(result, call_id)

    async def astop(self) -> None:
        sandbox, self._sandbox = self._sandbox, None
        self._rollout.live_sandbox = None
        if sandbox is not None:
            await sandbox.cleanup()


class TVCacheRollout:
    """One rollout of a task: an optional sandbox and tools, sharing one history of calls.

    The task is `task_id`, else that of the `TVCacheEnvGroupBuilder` making envs around it.
    `task_env` says what the task's environment is (an image, a dataset revision): a changed
    one never hits results of the old one.
    """

    def __init__(
        self,
        *,
        make_sandbox: SandboxMaker | None = None,
        task_id: str | None = None,
        client: TVCacheClient | None = None,
        task_env: Mapping[str, Any] | None = None,
        epoch: int | None = None,
    ) -> None:
        group = _group.get()
        if task_id is None and group is None:
            raise ValueError(
                "a tvcache rollout needs a task: pass task_id=, or make it while a "
                "TVCacheEnvGroupBuilder makes its envs"
            )
        self.task_id = _shared.task_slug(task_id if task_id is not None else group.task_id)  # type: ignore[union-attr]
        self.client = client or (group.client if group is not None else _shared.shared_client())
        self.task_env = dict(task_env if task_env is not None else group.task_env if group else {})
        self.epoch = epoch if epoch is not None or group is None else group.epoch
        self.make_sandbox = make_sandbox
        self.tools: dict[str, Tool] = {}
        self.read_only: set[str] = set(READ_ONLY_SANDBOX_CALLS)
        self.live_sandbox: SandboxInterface | None = None
        self.tool_calls: list[_ToolCallInFlight] = []
        self.rollout_id = uuid.uuid4().hex
        self.calls = AsyncRollout(self._open_executor)
        if group is not None:
            group.rollouts.append(self)

    @property
    def executor(self) -> ToolCallExecutor | None:
        """The rollout's executor (its counters: hits, misses, executed, ...), once it made a call."""
        return self.calls.executor

    @property
    def running_live(self) -> bool:
        """Whether the caller is this rollout's own tool, running live."""
        return _running.get() is self

    async def call(self, call: Call) -> RecordedResult:
        episode = _episode.get()
        if episode is not None:
            episode.add(self)
        return await self.calls.execute(call)

    async def call_tool(self, name: str, input: ToolInput) -> RecordedResult:
        made = _ToolCallInFlight(
            {"tool": name, "args": {"arguments": input.arguments, "call_id": _call_id_kind(input.call_id)}},
            input.call_id,
        )
        self.tool_calls.append(made)
        try:
            return await self.call(made.call)
        finally:
            self.tool_calls.remove(made)

    def live_call_id(self, call: Call) -> str | None:
        """The call id a tool call's live run gets: that of the call it answers, or for a replay
        of an earlier call, one of the same kind made up (its result's own id is recorded as the
        call's either way)."""
        made = next((made for made in self.tool_calls if made.call == call), None)
        if made is not None:
            return made.call_id
        kind = call["args"]["call_id"]
        return f"tvcache-replay-{uuid.uuid4().hex}" if kind == "given" else None if kind == "none" else ""

    async def end(self) -> None:
        """End the rollout: its last record is sent and its real sandbox, if any, cleaned up."""
        await self.calls.end()

    def _open_executor(self, calls: AsyncRollout) -> ToolCallExecutor:
        # One spec for every rollout of the task (a changed one would drop the task's graph):
        # tools declared read-only are observed so, call by call (_Sandbox.execute_observed).
        task = TaskSpec(
            env={"backend": "external", **self.task_env},
            tools=_shared.declared_tools(READ_ONLY_SANDBOX_CALLS),
            sandbox_budget=0,
        )
        return ToolCallExecutor(
            self.client,
            self.task_id,
            lambda: _Sandbox(self),
            rollout_id=self.rollout_id,
            epoch=self.epoch,
            snapshots=_shared.snapshots,
            task=task,
        )


class TVCacheSandbox:
    """A tinker-cookbook `SandboxInterface` whose calls go through tvcache; one rollout."""

    def __init__(self, make_sandbox: SandboxMaker, **rollout_options: Any) -> None:
        self.rollout = TVCacheRollout(make_sandbox=make_sandbox, **rollout_options)

    @property
    def sandbox_id(self) -> str:
        live = self.rollout.live_sandbox
        return live.sandbox_id if live is not None else f"tvcache-{self.rollout.rollout_id}"

    async def send_heartbeat(self, timeout: int = 30) -> None:
        live = self.rollout.live_sandbox
        if live is not None:  # no sandbox yet (every call hit so far): nothing to keep alive
            await live.send_heartbeat(timeout=timeout)

    async def run_command(
        self,
        command: str,
        workdir: str | None = None,
        timeout: int = 60,
        max_output_bytes: int | None = None,
    ) -> SandboxResult:
        if self.rollout.running_live:
            return await self._live.run_command(command, workdir, timeout, max_output_bytes)
        return await self._call(
            "run_command",
            {"command": command, "workdir": workdir, "timeout": timeout, "max_output_bytes": max_output_bytes},
        )

    async def read_file(self, path: str, max_bytes: int | None = None, timeout: int = 60) -> SandboxResult:
        if self.rollout.running_live:
            return await self._live.read_file(path, max_bytes, timeout)
        return await self._call("read_file", {"path": path, "max_bytes": max_bytes, "timeout": timeout})

    async def write_file(
        self, path: str, content: str | bytes, executable: bool = False, timeout: int = 60
    ) -> SandboxResult:
        if self.rollout.running_live:
            return await self._live.write_file(path, content, executable, timeout)
        body = (
            {"content_b64": base64.b64encode(content).decode("ascii")}
            if isinstance(content, bytes)
            else {"content": content}
        )
        return await self._call("write_file", {"path": path, **body, "executable": executable, "timeout": timeout})

    async def cleanup(self) -> None:
        await self.rollout.end()

    @property
    def _live(self) -> SandboxInterface:
        live = self.rollout.live_sandbox
        if live is None:
            raise RuntimeError("a tool of this rollout runs live without its sandbox")
        return live

    async def _call(self, name: str, args: dict[str, Any]) -> SandboxResult:
        result = await self.rollout.call({"tool": name, "args": args})
        return SandboxResult(
            stdout=result["stdout"], stderr=result["stderr"], exit_code=result["exit_code"], metrics=result["metrics"]
        )


def tvcache_sandbox_factory(
    sandbox_factory: Callable[..., Awaitable[SandboxInterface]], **rollout_options: Any
) -> Callable[..., Awaitable[TVCacheSandbox]]:
    """Wrap a sandbox factory (such as the Harbor recipe's `(env_dir, timeout) -> sandbox`): the
    wrapper answers at once with a TVCacheSandbox, which calls the factory with the same
    arguments on its first miss. It pickles if the factory does (builders travel to rollout
    workers pickled)."""
    return _TVCacheSandboxFactory(sandbox_factory, rollout_options)


@dataclass(frozen=True)
class _TVCacheSandboxFactory:
    sandbox_factory: Callable[..., Awaitable[SandboxInterface]]
    rollout_options: Mapping[str, Any]

    async def __call__(self, *args: Any, **kwargs: Any) -> TVCacheSandbox:
        return TVCacheSandbox(lambda: self.sandbox_factory(*args, **kwargs), **self.rollout_options)


class TVCacheTool:
    """A tinker-cookbook `Tool` whose `run` goes through tvcache.

    `rollout` puts the tool in an existing rollout's history (a sandbox's, when the tool and
    the sandbox touch one state); by default the tool is a rollout of its own. `read_only`
    declares that the tool changes nothing.
    """

    def __init__(
        self, tool: Tool, *, rollout: TVCacheRollout | None = None, read_only: bool = False, **rollout_options: Any
    ) -> None:
        if tool.name in SANDBOX_CALLS:
            raise ValueError(f"a tool named {tool.name!r} would be taken for the sandbox's own call")
        self.tool = tool
        self.rollout = rollout if rollout is not None else TVCacheRollout(**rollout_options)
        self.rollout.tools[tool.name] = tool
        if read_only:
            self.rollout.read_only.add(tool.name)

    @property
    def name(self) -> str:
        return self.tool.name

    @property
    def description(self) -> str:
        return self.tool.description

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return self.tool.parameters_schema

    def to_spec(self) -> Any:
        return self.tool.to_spec()

    async def run(self, input: ToolInput) -> ToolResult:
        result = await self.rollout.call_tool(self.name, input)
        messages = list(result["messages"])
        for index in result["call_id_at"]:
            messages[index] = {**messages[index], "tool_call_id": input.call_id}
        return ToolResult(
            messages=messages, should_stop=result["should_stop"], metrics=result["metrics"], metadata=result["metadata"]
        )


def _call_id_kind(call_id: str | None) -> str:
    # Part of a tool call's key: a tool answers a call with an id otherwise than one without.
    return "none" if call_id is None else "empty" if call_id == "" else "given"


def _recorded_tool_result(result: ToolResult, call_id: str | None) -> RecordedResult:
    """`result`'s fields as they are, but for the messages' `tool_call_id`s that are the call's
    own id: those are listed in `call_id_at`, and each answer puts its own call's id there."""
    messages: list[Any] = list(result.messages)
    call_id_at = []
    if call_id:
        for index, message in enumerate(messages):
            if isinstance(message, dict) and message.get("tool_call_id") == call_id:
                messages[index] = {**message, "tool_call_id": ""}
                call_id_at.append(index)
    return {
        "messages": messages,
        "call_id_at": call_id_at,
        "should_stop": result.should_stop,
        "metrics": result.metrics,
        "metadata": result.metadata,
    }


class _EpisodeEnv(Env):
    """An env of the group: when a step ends the episode, the rollouts it called end too."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.rollouts: set[TVCacheRollout] = set()

    async def initial_observation(self) -> Any:
        return await self.env.initial_observation()

    async def step(self, action: Any, *, extra: Any = None) -> StepResult:
        token = _episode.set(self.rollouts)
        try:
            result = await self.env.step(action, extra=extra)
        finally:
            _episode.reset(token)
        if result.episode_done:
            for rollout in list(self.rollouts):
                await rollout.end()
        return result

    def __getattr__(self, name: str) -> Any:
        if name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)


class TVCacheEnvGroupBuilder(EnvGroupBuilder):
    """An `EnvGroupBuilder` whose group is one tvcache task.

    Sandboxes and tools that the wrapped builder makes in `make_envs` (TVCacheSandbox,
    TVCacheTool, a `tvcache_sandbox_factory`) join the task; the envs end their rollouts at
    `episode_done` (unless `end_on_episode_done=False`, for group rewards that still use the
    sandboxes), and `cleanup()` ends the rest. `rollouts` are those of the last group made
    (their executors count hits, misses, ...). The builder stays picklable: it holds the
    service's address, not a client.
    """

    def __init__(
        self,
        inner: EnvGroupBuilder,
        task_id: str,
        *,
        task_env: Mapping[str, Any] | None = None,
        epoch: int | None = None,
        url: str | None = None,
        token: str | None = None,
        end_on_episode_done: bool = True,
    ) -> None:
        self.inner = inner
        self.task_id = task_id
        self.task_env = dict(task_env or {})
        self.epoch = epoch
        self.url, self.token = url, token
        self.end_on_episode_done = end_on_episode_done
        self._current: _Group | None = None

    @property
    def rollouts(self) -> tuple[TVCacheRollout, ...]:
        return tuple(self._current.rollouts) if self._current is not None else ()

    async def make_envs(self) -> Sequence[Env]:
        group = _Group(self.task_id, _shared.shared_client(self.url, self.token), self.task_env, self.epoch)
        self._current = group
        token = _group.set(group)
        try:
            envs = await self.inner.make_envs()
        finally:
            _group.reset(token)
        return [_EpisodeEnv(env) for env in envs] if self.end_on_episode_done else list(envs)

    async def compute_group_rewards(self, trajectory_group: list[Any], env_group: Sequence[Env]) -> Any:
        envs = [env.env if isinstance(env, _EpisodeEnv) else env for env in env_group]
        return await self.inner.compute_group_rewards(trajectory_group, envs)

    async def cleanup(self) -> None:
        # The group stays `_current` (its rollouts' counters readable); ending twice is a no-op.
        try:
            for rollout in self.rollouts:
                await rollout.end()
        finally:
            await self.inner.cleanup()

    def logging_tags(self) -> list[str]:
        return self.inner.logging_tags()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_current": None}
