"""One video task's GRPO group through tinker-cookbook's own rollout loop (`do_group_rollout`):
uncached, then passes through tvcache's Tinker integration on one task.

Runs in the tinker venv from the checkout's root, as lab/replay/video/tinker.py does
(`python -m lab.frameworks.video_tinker`), against a served tvcache (TVCACHE_URL,
TVCACHE_TOKEN), and prints one JSON summary: per pass, whether what the rollouts produced is the
uncached pass's byte for byte (the TrajectoryGroup's observations, actions, rewards, metrics and
logs; every StepResult and ToolResult; the message histories), what ran for real (sandboxes,
tool programs), the tool time, and the executors' counters; then the service's counters.

The group is the replay's (lab/replay/video): a video of the seed and the policy's rollouts of
one epoch. Each env is the cookbook's tool-use agent (`build_agent_tool_env`, its Qwen3
renderer) with the eight video tools as cookbook `Tool`s over a sandbox: a folder holding a copy
of the video (the notes driver's FolderSandbox, made by a factory as in the cookbook's Harbor
recipe). A tool runs its program in the sandbox (`run_command`: `python -m
lab.replay.video.tools NAME ARGS`). Through tvcache the sandbox is a `TVCacheSandbox`, made on a
rollout's first miss, each tool a `TVCacheTool` in the sandbox's rollout (the read-only ones
declared so), the group a `TVCacheEnvGroupBuilder`. The model is scripted as in
tinker_rollouts.py: each sample's next call of its rollout, then its answer.

    python -m lab.frameworks.video_tinker [--seed 1] [--video 0] [--epoch 0] [--group-size 4]
        [--passes 2] [--latency-scale 1] [--task-id ID]

The cached passes share one task, so the first runs cold (the group's samples share calls) and
the later ones repeat it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

from tinker_cookbook import tokenizer_utils
from tinker_cookbook.renderers import get_renderer
from tinker_cookbook.rl.rollouts import do_group_rollout
from tinker_cookbook.rl.types import Env, EnvGroupBuilder
from tinker_cookbook.tool_use import ToolInput, ToolResult, build_agent_tool_env, error_tool_result, simple_tool_result

from lab.frameworks import tinker_rollouts as notes
from lab.replay.video.footage import generate
from lab.replay.video.policy import VideoPolicy
from lab.replay.video.tools import TOOLS, TOOLS_VERSION, VideoTool
from tvclient.integrations import _shared
from tvclient.integrations.tinker import TVCacheEnvGroupBuilder, TVCacheTool, tvcache_sandbox_factory

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "You answer questions about a long video. Use the video tools, then answer with one option letter."
PRODUCED = ("group_repr", "trajectories", "total_rewards", "seen")


class VideoSandbox(notes.FolderSandbox):
    """The notes driver's folder sandbox, holding a copy of the video."""

    def __init__(self, video: Path, timeout: int) -> None:
        super().__init__(video, timeout)
        shutil.copytree(video, self.root, dirs_exist_ok=True)


async def make_video_sandbox(video: Path, timeout: int) -> VideoSandbox:
    """A sandbox factory with the Harbor recipe's signature."""
    return VideoSandbox(video, timeout)


class VideoProgram:
    """A video tool as a cookbook `Tool`: it runs the tool's program in the sandbox."""

    def __init__(self, tool: VideoTool, sandbox: Any, latency_scale: float) -> None:
        self.tool, self.sandbox, self.latency_scale = tool, sandbox, latency_scale

    @property
    def name(self) -> str:
        return self.tool.name

    @property
    def description(self) -> str:
        return self.tool.description

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return {"type": "object", "properties": self.tool.parameters, "required": sorted(self.tool.parameters)}

    def to_spec(self) -> Any:
        return {"name": self.name, "description": self.description, "parameters": self.parameters_schema}

    async def run(self, input: ToolInput) -> ToolResult:
        arguments = shlex.quote(json.dumps(input.arguments, sort_keys=True))
        command = (
            f"{shlex.quote(sys.executable)} -m lab.replay.video.tools {self.name} {arguments} "
            f"--latency-scale {self.latency_scale}"
        )
        done = await self.sandbox.run_command(command, timeout=120)
        call_id = input.call_id or ""
        if done.exit_code != 0:
            return error_tool_result(done.stderr[-400:], call_id=call_id, name=self.name)
        return simple_tool_result(done.stdout, call_id=call_id, name=self.name)


async def grade(history: list[Any]) -> tuple[float, dict[str, float]]:
    """The reward: 1 if the last answer the `answer` tool gave says right."""
    answers = [m for m in history if m.get("role") == "tool" and m.get("name") == "answer"]
    right = bool(answers) and json.loads(answers[-1]["content"]).get("correct") is True
    return (1.0 if right else 0.0), {"answered": float(bool(answers))}


class VideoGroupBuilder(EnvGroupBuilder):
    """A group of the cookbook's tool-use envs on one video, each with a sandbox of its own."""

    def __init__(self, video: Path, question: dict[str, Any], scripts: dict[int, list[str]], **options: Any):
        self.video, self.question, self.scripts = video, question, scripts
        self.cached, self.latency_scale = options["cached"], options["latency_scale"]
        self.sandbox_factory = tvcache_sandbox_factory(make_video_sandbox) if self.cached else make_video_sandbox
        self.sandboxes: list[Any] = []
        self.seen: dict[str, dict[str, Any]] = {}

    async def make_envs(self) -> list[Env]:
        renderer = get_renderer(notes.RENDERER, tokenizer_utils.get_tokenizer(notes.MODEL))
        options = "\n".join(f"{letter}. {text}" for letter, text in sorted(self.question["options"].items()))
        envs: list[Env] = []
        for sample, script in self.scripts.items():
            seen = self.seen[str(sample)] = {"tools": []}
            sandbox = await self.sandbox_factory(self.video, 600)
            self.sandboxes.append(sandbox)
            tools: list[Any] = [VideoProgram(tool, sandbox, self.latency_scale) for tool in TOOLS.values()]
            if self.cached:
                tools = [TVCacheTool(t, rollout=sandbox.rollout, read_only=TOOLS[t.name].read_only) for t in tools]
            tools = [notes.SeenTool(t, seen["tools"]) for t in tools]
            prefix = renderer.create_conversation_prefix_with_tools([t.to_spec() for t in tools], system_prompt=SYSTEM)
            user = f"{self.question['question']}\n{options}\nSample {sample}."
            env = build_agent_tool_env(
                renderer, tools, prefix + [{"role": "user", "content": user}], grade, max_turns=len(script) + 1
            )
            envs.append(notes.SeenEnv(env))
        return envs

    async def compute_group_rewards(self, trajectory_group: list[Any], env_group: Any) -> list[Any]:
        for sample, env in enumerate(env_group):
            self.seen[str(sample)]["steps"] = env.steps
            self.seen[str(sample)]["messages"] = repr(env.env.message_env.history)
        return [(0.0, {"steps": float(len(env.steps))}) for env in env_group]

    async def cleanup(self) -> None:
        for sandbox in self.sandboxes:
            await sandbox.cleanup()


class ScriptedModel(notes.ScriptedPolicy):
    """The notes driver's scripted model, reading the video group's scripts."""

    def __init__(self, scripts: dict[int, list[str]]) -> None:
        super().__init__()
        self.scripts = scripts


def scripts(policy: VideoPolicy, epoch: int, group_size: int) -> dict[int, list[str]]:
    """Each sample's turns: its rollout's calls, one a turn, each with an id, then its answer."""
    out = {}
    for sample in range(group_size):
        calls = policy.rollout(epoch, sample)
        turns = [notes.turn((c["tool"], c["args"], f"call-{sample}-{k}")) for k, c in enumerate(calls)]
        out[sample] = [*turns, f"My answer is {calls[-1]['args']['option']}."]
    return out


async def one_pass(
    video: Path, question: dict[str, Any], group: dict[int, list[str]], task: dict[str, Any] | None, scale: float
) -> dict[str, Any]:
    notes.ran.clear()
    notes.tool_seconds = 0.0
    inner = VideoGroupBuilder(video, question, group, cached=task is not None, latency_scale=scale)
    builder: EnvGroupBuilder = inner
    if task is not None:
        builder = TVCacheEnvGroupBuilder(inner, task["id"], task_env=task["env"])
    started = time.perf_counter()
    produced = await do_group_rollout(builder, ScriptedModel(group))
    document: dict[str, Any] = {
        "mode": "uncached" if task is None else "cached",
        "group_repr": repr(produced),
        "trajectories": notes.trajectories(produced),
        "total_rewards": produced.get_total_rewards(),
        "seen": inner.seen,
        "ran": dict(notes.ran),
        "wall_s": round(time.perf_counter() - started, 3),
        "tool_s": round(notes.tool_seconds, 3),
    }
    if isinstance(builder, TVCacheEnvGroupBuilder):
        document["executor"] = notes.executor_counters(builder)
    return document


def summary(done: dict[str, Any], uncached: dict[str, Any] | None) -> dict[str, Any]:
    out = {key: done[key] for key in ("mode", "total_rewards", "ran", "wall_s", "tool_s", "executor") if key in done}
    if uncached is not None and done is not uncached:
        out["differs"] = [name for name in PRODUCED if done[name] != uncached[name]]
        out["identical_to_uncached"] = not out["differs"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--video", type=int, default=0, help="the replay's task index")
    parser.add_argument("--epoch", type=int, default=0, help="the policy's epoch the group's rollouts come from")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--passes", type=int, default=2, help="cached passes over one task")
    parser.add_argument("--latency-scale", type=float, default=1.0)
    parser.add_argument("--task-id", default=f"video-tinker-{uuid.uuid4().hex[:12]}")
    options = parser.parse_args()
    # The tools' programs run in the sandboxes' folders and import the checkout's lab/.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    footage = generate(options.seed, options.video)
    group = scripts(VideoPolicy(footage, options.seed), options.epoch, options.group_size)
    task = {"id": options.task_id, "env": {"workload": "video", "footage": footage.digest(), "tools": TOOLS_VERSION}}
    with tempfile.TemporaryDirectory(prefix="tvcache-video-tinker-") as folder:
        video = Path(folder) / footage.video
        footage.write(video)
        passes = [asyncio.run(one_pass(video, footage.question, group, None, options.latency_scale))]
        for _ in range(options.passes):
            passes.append(asyncio.run(one_pass(video, footage.question, group, task, options.latency_scale)))
    stats = _shared.shared_client().stats(options.task_id)
    _shared.close_clients()
    for number, done in enumerate(passes):
        print(
            f"pass {number} ({done['mode']}): wall {done['wall_s']:.1f} s, tool {done['tool_s']:.1f} s, "
            f"ran {done['ran']}, executors {done.get('executor', {})}",
            file=sys.stderr,
        )
    json.dump(
        {
            "framework": f"tinker-cookbook {metadata.version('tinker-cookbook')}",
            "task_id": options.task_id,
            "video": footage.video,
            "epoch": options.epoch,
            "group_size": options.group_size,
            "calls": sum(len(turns) - 1 for turns in group.values()),
            "passes": [summary(done, passes[0]) for done in passes],
            "service": {"per_epoch": stats["per_epoch"], "per_tool": stats["per_tool"]},
        },
        sys.stdout,
    )
    sys.stdout.write("\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
