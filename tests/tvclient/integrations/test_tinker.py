"""Tinker: env groups made, stepped and cleaned up as tinker-cookbook's rollouts do, with a
sandbox of the cookbook's SandboxInterface (real shell commands in a folder) made through a
factory as in its Harbor recipe, against a served tvcache. EnvGroupBuilder, Env, StepResult,
ToolInput, ToolResult, SandboxResult and tinker.ModelInput are the cookbook's own
(frameworks.py)."""

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest

from . import frameworks

frameworks.load_tinker()

import tinker  # noqa: E402
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, StepResult  # noqa: E402
from tinker_cookbook.sandbox.sandbox_interface import SandboxInterface, SandboxResult  # noqa: E402
from tinker_cookbook.tool_use.types import ToolInput, ToolResult  # noqa: E402

from tvclient.integrations.tinker import (  # noqa: E402
    TVCacheEnvGroupBuilder,
    TVCacheSandbox,
    TVCacheTool,
    tvcache_sandbox_factory,
)


class FolderSandbox:
    """A SandboxInterface running `bash -c` in a folder of its own; counts what it does."""

    made: list["FolderSandbox"] = []
    commands: list[str] = []

    def __init__(self, env_dir: Path, timeout: int) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="tinker-sandbox-"))
        FolderSandbox.made.append(self)

    @property
    def sandbox_id(self) -> str:
        return self.root.name

    async def send_heartbeat(self, timeout: int = 30) -> None:
        pass

    async def run_command(self, command, workdir=None, timeout=60, max_output_bytes=None) -> SandboxResult:
        FolderSandbox.commands.append(command)
        process = await asyncio.create_subprocess_exec(
            "bash", "-c", command, cwd=self.root / (workdir or "."),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout)
        return SandboxResult(stdout=stdout.decode(), stderr=stderr.decode(), exit_code=process.returncode)

    async def read_file(self, path, max_bytes=None, timeout=60) -> SandboxResult:
        return await self.run_command(f"cat {path}", timeout=timeout)

    async def write_file(self, path, content, executable=False, timeout=60) -> SandboxResult:
        target = self.root / path
        target.write_bytes(content if isinstance(content, bytes) else content.encode())
        if executable:
            target.chmod(0o755)
        return SandboxResult(stdout="", stderr="", exit_code=0)

    async def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


async def make_folder_sandbox(env_dir: Path, timeout: int) -> SandboxInterface:
    """A sandbox factory with the Harbor recipe's signature."""
    return FolderSandbox(env_dir, timeout)


class ScriptEnv(Env):
    """Each action names the next command of its script; the last step grades by reading `f`."""

    def __init__(self, sandbox, script: list[str]) -> None:
        self.sandbox, self.script, self.outputs = sandbox, script, []

    async def initial_observation(self):
        return tinker.ModelInput.from_ints([]), []

    async def step(self, action, *, extra=None) -> StepResult:
        result = await self.sandbox.run_command(self.script[action[0]], timeout=30)
        self.outputs.append(result.stdout)
        done = action[0] == len(self.script) - 1
        reward = 0.0
        if done:  # graded inside the step, as the cookbook's tool envs do
            reward = float((await self.sandbox.read_file("f")).stdout.count("a"))
        return StepResult(reward=reward, episode_done=done, next_observation=tinker.ModelInput.from_ints([]),
                          next_stop_condition=[])


class ScriptGroupBuilder(EnvGroupBuilder):
    """Like the cookbook's HarborEnvGroupBuilder: a sandbox per env from `sandbox_factory`,
    every sandbox cleaned up in cleanup()."""

    def __init__(self, scripts, sandbox_factory) -> None:
        self.scripts, self.sandbox_factory, self.sandboxes = scripts, sandbox_factory, []

    async def make_envs(self):
        envs = []
        for script in self.scripts:
            sandbox = await self.sandbox_factory(Path("environment"), 600)
            self.sandboxes.append(sandbox)
            envs.append(ScriptEnv(sandbox, script))
        return envs

    async def cleanup(self) -> None:
        for sandbox in self.sandboxes:
            await sandbox.cleanup()


async def group_rollout(builder: EnvGroupBuilder):
    """tinker-cookbook's group rollout, one env after the other: make, step to the end, group
    rewards, cleanup."""
    envs = await builder.make_envs()
    try:
        rewards = []
        for env in envs:
            await env.initial_observation()
            step, total = 0, 0.0
            while True:
                result = await env.step([step])
                total += result.reward
                step += 1
                if result.episode_done:
                    break
            rewards.append(total)
        await builder.compute_group_rewards([None] * len(envs), envs)
        return [env.env.outputs for env in envs], rewards, envs
    finally:
        await builder.cleanup()


def cached_group(tvcache, task_id, scripts):
    return TVCacheEnvGroupBuilder(ScriptGroupBuilder(scripts, tvcache_sandbox_factory(make_folder_sandbox)),
                                  task_id, url=tvcache.url, token=tvcache.token, task_env={"image": "folder"})


@pytest.mark.django_db(transaction=True)
def test_a_group_is_a_task_and_sandboxes_start_only_on_a_miss(tvcache, task_id):
    FolderSandbox.made.clear()
    script = ["echo a >> f", "cat f"]
    outputs, rewards, envs = asyncio.run(group_rollout(cached_group(tvcache, task_id, [script, script])))
    assert outputs == [["", "a\n"], ["", "a\n"]] and rewards == [1.0, 1.0]
    assert len(FolderSandbox.made) == 1  # the second env's calls all hit: it never made a sandbox
    assert not FolderSandbox.made[0].root.exists()  # episode done: its sandbox was cleaned up
    assert tvcache.stats(task_id)["hits"] == 3

    # The next step's group of the same task: a longer script misses after the cached write,
    # replays it in a new sandbox, and reads both writes.
    longer = ["echo a >> f", "echo b >> f", "cat f"]
    outputs, rewards, _ = asyncio.run(group_rollout(cached_group(tvcache, task_id, [longer, script])))
    assert outputs == [["", "", "a\nb\n"], ["", "a\n"]] and rewards == [1.0, 1.0]
    assert len(FolderSandbox.made) == 2


class Notebook:
    """A tinker-cookbook Tool keeping notes in Python."""

    name, description = "note", "append a note"
    parameters_schema = {"type": "object", "properties": {"text": {"type": "string"}}}
    runs = 0

    def __init__(self) -> None:
        self.notes = []

    def to_spec(self):
        return {"name": self.name, "description": self.description, "parameters": self.parameters_schema}

    async def run(self, input: ToolInput) -> ToolResult:
        Notebook.runs += 1
        self.notes.append(input.arguments["text"])
        return ToolResult(messages=[{"role": "tool", "content": " ".join(self.notes),
                                     "tool_call_id": input.call_id, "name": self.name}],
                          metrics={"notes": float(len(self.notes))})


@pytest.mark.django_db(transaction=True)
def test_tools_run_through_the_cache_and_answer_their_own_call_id(tvcache, task_id):
    async def episode(call_ids, texts):
        tool = TVCacheTool(Notebook(), task_id=task_id, client=tvcache)
        results = [await tool.run(ToolInput(arguments={"text": text}, call_id=call_id))
                   for call_id, text in zip(call_ids, texts)]
        await tool.rollout.end()
        return results

    async def run():
        Notebook.runs = 0
        first = await episode(["c1", "c2"], ["x", "y"])
        second = await episode(["d1", "d2"], ["x", "y"])
        assert Notebook.runs == 2  # the second episode's calls hit
        assert [m.messages[0]["content"] for m in second] == ["x", "x y"]
        assert [m.messages[0]["tool_call_id"] for m in second] == ["d1", "d2"]
        assert second[1].metrics == first[1].metrics == {"notes": 2.0}
        third = await episode(["e1", "e2"], ["x", "z"])
        assert third[1].messages[0]["content"] == "x z"

    asyncio.run(run())


@pytest.mark.django_db(transaction=True)
def test_file_writes_are_part_of_the_history(tvcache, task_id):
    async def episode(content):
        sandbox = TVCacheSandbox(lambda: make_folder_sandbox(Path("environment"), 600), task_id=task_id,
                                 client=tvcache)
        await sandbox.write_file("run.sh", content, executable=True)
        result = await sandbox.run_command("./run.sh")
        await sandbox.cleanup()
        return result.stdout

    async def run():
        assert await episode(b"#!/bin/sh\necho one\n") == "one\n"
        made = len(FolderSandbox.made)
        assert await episode(b"#!/bin/sh\necho one\n") == "one\n"
        assert len(FolderSandbox.made) == made  # a hit: no sandbox
        assert await episode("#!/bin/sh\necho two\n") == "two\n"

    asyncio.run(run())
