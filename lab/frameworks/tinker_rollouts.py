"""tinker-cookbook's own group rollout (`do_group_rollout`), uncached and through tvcache.

Runs in the tinker venv (`python -m lab.frameworks.venvs tinker`) against a served tvcache
(TVCACHE_URL, TVCACHE_TOKEN) and prints one JSON document: for each pass, what the rollouts
produced (the TrajectoryGroup, every StepResult, ToolResult, SandboxResult and message history,
each as its repr), the counters of what ran for real (sandboxes started, commands, tool runs),
the executors' and the service's counters, and wall and tool times.

The group is the cookbook's tool-use agent: `build_agent_tool_env` envs (EnvFromMessageEnv over
AgentToolMessageEnv) with the cookbook's Qwen3 renderer, a bash tool (the cookbook's `@tool`)
over a sandbox made by a factory as in its Harbor recipe, and two Python tools: `note`, which
keeps notes (state) and answers metadata whose keys are not sorted, and `lookup`, a read-only
catalogue whose metadata holds a tuple (no exact JSON: always run live); and `stamp`, a tool
that changes the sandbox through it, in the sandbox's rollout. The episode ends when
the model answers without a tool call; the reward function reads the sandbox's notes file.

Only the model is scripted: a `TokenCompleter` that answers each sample's next turn with fixed
tokens. Its tokenizer is a byte-level BPE built here (Qwen3's special tokens, no merges): model
files cannot be fetched on this machine, and the renderer needs only encode and decode.

    python lab/frameworks/tinker_rollouts.py [--mode both|uncached|cached] [--passes 2]
        [--group-size 3] [--task-id ID]

Cached passes share one task, so the first runs cold and the later ones repeat it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import tinker
from tinker_cookbook import tokenizer_utils
from tinker_cookbook.completers import TokenCompleter, TokensWithLogprobs
from tinker_cookbook.renderers import get_renderer
from tinker_cookbook.rl.rollouts import do_group_rollout
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, StepResult, TrajectoryGroup
from tinker_cookbook.sandbox import SandboxInterface, SandboxResult
from tinker_cookbook.tool_use import (
    ToolInput,
    ToolResult,
    build_agent_tool_env,
    simple_tool_result,
    tool,
)

from tvclient.integrations import _shared
from tvclient.integrations.tinker import (
    TVCacheEnvGroupBuilder,
    TVCacheTool,
    tvcache_sandbox_factory,
)

MODEL = "tvcache/byte-level-qwen3"
RENDERER = "qwen3_instruct"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# What ran for real in this pass: sandboxes made, their operations, the Python tools' runs.
ran: Counter[str] = Counter()
tool_seconds = 0.0


def byte_level_tokenizer() -> Any:
    """A Hugging Face fast tokenizer whose tokens are bytes, plus Qwen3's chat tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={symbol: index for index, symbol in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[2]
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [SPECIAL_TOKENS[1]]})
    return tokenizer


_tokenizer = byte_level_tokenizer()
tokenizer_utils.register_tokenizer(MODEL, lambda: _tokenizer)


class FolderSandbox:
    """A SandboxInterface running `bash -c` in a folder of its own, as a container would."""

    def __init__(self, env_dir: Path, timeout: int) -> None:
        ran["sandboxes_started"] += 1
        self.root = Path(tempfile.mkdtemp(prefix="tinker-sandbox-"))

    @property
    def sandbox_id(self) -> str:
        return self.root.name

    async def send_heartbeat(self, timeout: int = 30) -> None:
        pass

    async def run_command(
        self, command: str, workdir: str | None = None, timeout: int = 60, max_output_bytes: int | None = None
    ) -> SandboxResult:
        ran["run_command"] += 1
        return await self._bash(command, workdir, timeout, max_output_bytes)

    async def read_file(self, path: str, max_bytes: int | None = None, timeout: int = 60) -> SandboxResult:
        ran["read_file"] += 1
        return await self._bash(f"cat {path}", None, timeout, max_bytes)

    async def write_file(
        self, path: str, content: str | bytes, executable: bool = False, timeout: int = 60
    ) -> SandboxResult:
        ran["write_file"] += 1
        target = self.root / path
        target.write_bytes(content if isinstance(content, bytes) else content.encode())
        if executable:
            target.chmod(0o755)
        return SandboxResult(stdout="", stderr="", exit_code=0)

    async def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    async def _bash(self, command: str, workdir: str | None, timeout: int, limit: int | None) -> SandboxResult:
        global tool_seconds
        started = time.perf_counter()
        process = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            command,
            cwd=self.root / (workdir or "."),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout)
        tool_seconds += time.perf_counter() - started
        stdout, stderr = stdout[:limit], stderr[:limit]
        # Keys not in sorted order: a hit must give them back as the sandbox did.
        return SandboxResult(
            stdout=stdout.decode(),
            stderr=stderr.decode(),
            exit_code=process.returncode,
            metrics={"stdout_bytes": len(stdout), "backend": "folder"},
        )


async def make_folder_sandbox(env_dir: Path, timeout: int) -> SandboxInterface:
    """A sandbox factory with the Harbor recipe's signature."""
    return FolderSandbox(env_dir, timeout)


class Bash:
    """The bash tool over the env's sandbox, as the Harbor recipe's HarborBashTool."""

    def __init__(self, sandbox: SandboxInterface, seen: list[str]) -> None:
        self.sandbox, self.seen = sandbox, seen

    @tool
    async def bash(self, command: Annotated[str, "The bash command to execute."]) -> ToolResult:
        """Execute a bash command in the sandbox."""
        result = await self.sandbox.run_command(command, timeout=30)
        self.seen.append(repr(result))
        return simple_tool_result(
            json.dumps({"exit_code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr})
        )


class Stamps:
    """A tool that changes the sandbox through the sandbox it is given, as the Harbor recipe's
    tools do: through tvcache it joins the sandbox's rollout (`rollout=sandbox.rollout`)."""

    def __init__(self, sandbox: SandboxInterface) -> None:
        self.sandbox = sandbox

    @tool
    async def stamp(self, text: Annotated[str, "The stamp."]) -> ToolResult:
        """Stamp the stamps file."""
        result = await self.sandbox.run_command(f"echo {text} >> stamps.txt && wc -l < stamps.txt", timeout=30)
        return simple_tool_result(result.stdout, metrics={"stamps": float(result.stdout)})


class Notes:
    """Notes kept in Python: a tool whose state is the process's, not a sandbox's."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    @tool
    async def note(self, text: Annotated[str, "The note to keep."]) -> ToolResult:
        """Keep a note."""
        ran["note"] += 1
        self.notes.append(text)
        return simple_tool_result(
            f"{len(self.notes)} notes",
            metrics={"notes": float(len(self.notes))},
            metadata={"zeta": len(self.notes), "alpha": text, "mid": {"y": 1, "b": [2]}},
        )


CATALOGUE = {"a": "the first letter", "b": "the second letter"}


@tool
async def lookup(key: Annotated[str, "What to look up."]) -> ToolResult:
    """Look a word up in the catalogue."""
    ran["lookup"] += 1
    text = CATALOGUE.get(key, "not found")
    # A tuple has no exact JSON form: tvcache runs this tool live every time.
    return simple_tool_result(text, metadata={"span": (0, len(text))})


class SeenTool:
    """A tool as the env sees it, keeping the repr of every ToolResult it answers."""

    def __init__(self, tool: Any, seen: list[str]) -> None:
        self.tool, self.seen = tool, seen

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
        # In the order the calls were made (a turn's calls run at once and end in any order).
        slot = len(self.seen)
        self.seen.append(None)
        result = await self.tool.run(input)
        self.seen[slot] = f"{input.call_id!r} {result!r}"
        return result


class SeenEnv(Env):
    """An env as the rollout loop sees it, keeping the repr of every StepResult it answers."""

    def __init__(self, env: Env) -> None:
        self.env, self.steps = env, []

    async def initial_observation(self) -> Any:
        return await self.env.initial_observation()

    async def step(self, action: Any, *, extra: Any = None) -> StepResult:
        result = await self.env.step(action, extra=extra)
        self.steps.append(repr(result))
        return result

    def __getattr__(self, name: str) -> Any:
        if name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)


class Grader:
    """The reward: one point per line of the sandbox's notes file."""

    def __init__(self, sandbox: SandboxInterface, seen: list[str]) -> None:
        self.sandbox, self.seen = sandbox, seen

    async def __call__(self, history: list[Any]) -> tuple[float, dict[str, float]]:
        result = await self.sandbox.read_file("notes.txt")
        self.seen.append(repr(result))
        lines = float(result.stdout.count("\n"))
        return lines, {"lines": lines}


class NotesGroupBuilder(EnvGroupBuilder):
    """A group of the cookbook's tool-use envs on one task, each with a sandbox and notes."""

    def __init__(self, group_size: int, *, cached: bool) -> None:
        self.group_size, self.cached = group_size, cached
        self.sandbox_factory = tvcache_sandbox_factory(make_folder_sandbox) if cached else make_folder_sandbox
        self.sandboxes: list[Any] = []
        self.seen: dict[str, list[Any]] = {}

    async def make_envs(self) -> list[Env]:
        renderer = get_renderer(RENDERER, tokenizer_utils.get_tokenizer(MODEL))
        envs: list[Env] = []
        for sample in range(self.group_size):
            seen = self.seen[str(sample)] = {"tools": [], "sandbox": []}
            sandbox = await self.sandbox_factory(Path("environment"), 600)
            self.sandboxes.append(sandbox)
            notes = Notes()
            tools = [Bash(sandbox, seen["sandbox"]).bash, Stamps(sandbox).stamp, notes.note, lookup]
            if self.cached:
                tools[1:] = [
                    TVCacheTool(tools[1], rollout=sandbox.rollout),
                    TVCacheTool(notes.note),
                    TVCacheTool(lookup, read_only=True),
                ]
            tools = [SeenTool(each, seen["tools"]) for each in tools]
            prefix = renderer.create_conversation_prefix_with_tools(
                [each.to_spec() for each in tools], system_prompt="You keep notes in notes.txt."
            )
            envs.append(
                SeenEnv(
                    build_agent_tool_env(
                        renderer,
                        tools,
                        prefix + [{"role": "user", "content": f"Keep the notes. Sample {sample}."}],
                        Grader(sandbox, seen["sandbox"]),
                        max_turns=8,
                    )
                )
            )
        return envs

    async def compute_group_rewards(self, trajectory_group: list[Any], env_group: Any) -> list[Any]:
        for sample, env in enumerate(env_group):
            self.seen[str(sample)]["steps"] = env.steps
            self.seen[str(sample)]["messages"] = repr(env.env.message_env.history)
        return [(0.0, {"steps": float(len(env.steps))}) for env in env_group]

    async def cleanup(self) -> None:
        for sandbox in self.sandboxes:
            await sandbox.cleanup()


def turn(*calls: tuple[str, dict[str, Any], str | None]) -> str:
    blocks = []
    for name, arguments, call_id in calls:
        payload = {"name": name, "arguments": arguments} | ({"id": call_id} if call_id else {})
        blocks.append(f"<tool_call>\n{json.dumps(payload)}\n</tool_call>")
    return "\n".join(blocks)


def scripts() -> dict[int, list[str]]:
    """What the model answers, by sample and turn. Samples 0 and 1 act alike (with call ids
    of their own), sample 2 goes another way after the first command; sample 2's lookups come
    without call ids."""

    def writer(sample: int) -> list[str]:
        return [
            turn(("bash", {"command": "echo a >> notes.txt"}, f"call-{sample}-0")),
            turn(("note", {"text": "wrote a"}, f"call-{sample}-1"), ("lookup", {"key": "a"}, f"call-{sample}-2")),
            turn(("stamp", {"text": "x"}, f"call-{sample}-3")),
            turn(("bash", {"command": "cat notes.txt; ls"}, f"call-{sample}-4")),
            "The notes are written.",
        ]

    return {
        0: writer(0),
        1: writer(1),
        2: [
            turn(("bash", {"command": "echo a >> notes.txt"}, "call-2-0")),
            turn(("bash", {"command": "echo b >> notes.txt && wc -l notes.txt"}, "call-2-1")),
            turn(("note", {"text": "wrote a and b"}, "call-2-2"), ("lookup", {"key": "b"}, None)),
            turn(("stamp", {"text": "y"}, "call-2-3")),
            turn(("lookup", {"key": "a"}, None), ("bash", {"command": "cat notes.txt"}, "call-2-5")),
            "Both notes are written.",
        ],
    }


class ScriptedPolicy(TokenCompleter):
    """The model: each sample's next turn, read off the observation it is given."""

    def __init__(self) -> None:
        self.scripts = scripts()
        self.end = _tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[2])

    async def __call__(
        self, model_input: tinker.ModelInput, stop: Any, *, max_tokens: int | None = None
    ) -> TokensWithLogprobs:
        text = _tokenizer.decode(model_input.to_ints())
        sample = int(re.search(r"Sample (\d+)\.", text).group(1))  # type: ignore[union-attr]
        answer = self.scripts[sample][text.count("<|im_start|>assistant") - 1]
        tokens = _tokenizer.encode(answer, add_special_tokens=False) + [self.end]
        return TokensWithLogprobs(tokens=tokens, maybe_logprobs=[0.0] * len(tokens))


def trajectories(group: TrajectoryGroup) -> list[dict[str, Any]]:
    return [
        {
            "observations": [transition.ob.to_ints() for transition in trajectory.transitions]
            + [trajectory.final_ob.to_ints()],
            "actions": [transition.ac.tokens for transition in trajectory.transitions],
            "rewards": [transition.reward for transition in trajectory.transitions],
            "metrics": [transition.metrics for transition in trajectory.transitions],
            "logs": [transition.logs for transition in trajectory.transitions],
            "stop_reason": trajectory.stop_reason,
        }
        for trajectory in group.trajectories_G
    ]


EXECUTOR_COUNTERS = ("hits", "misses", "executed", "replayed", "waited", "uncacheable", "record_failures")


def executor_counters(builder: TVCacheEnvGroupBuilder) -> dict[str, int]:
    executors = [rollout.executor for rollout in builder.rollouts if rollout.executor is not None]
    counters = {name: sum(getattr(executor, name) for executor in executors) for name in EXECUTOR_COUNTERS}
    counters["detached"] = sum(executor.detached for executor in executors)
    counters["offline"] = sum(getattr(executor, "offline", False) for executor in executors)
    counters["rollouts"] = len(builder.rollouts)
    return counters


async def one_pass(group_size: int, task_id: str | None) -> dict[str, Any]:
    global tool_seconds
    ran.clear()
    tool_seconds = 0.0
    inner = NotesGroupBuilder(group_size, cached=task_id is not None)
    builder: EnvGroupBuilder = inner
    if task_id is not None:
        builder = TVCacheEnvGroupBuilder(inner, task_id, task_env={"image": "folder", "recipe": "notes"})
    started = time.perf_counter()
    group = await do_group_rollout(builder, ScriptedPolicy())
    wall_ms = (time.perf_counter() - started) * 1000
    document: dict[str, Any] = {
        "mode": "uncached" if task_id is None else "cached",
        "group_repr": repr(group),
        "trajectories": trajectories(group),
        "total_rewards": group.get_total_rewards(),
        "seen": inner.seen,
        "ran": dict(ran),
        "wall_ms": wall_ms,
        "tool_ms": tool_seconds * 1000,
    }
    if isinstance(builder, TVCacheEnvGroupBuilder):
        document["executor"] = executor_counters(builder)
    return document


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("both", "uncached", "cached"), default="both")
    parser.add_argument("--passes", type=int, default=2, help="cached passes over one task")
    parser.add_argument("--group-size", type=int, default=3)
    parser.add_argument("--task-id", default=f"tinker-notes-{uuid.uuid4().hex[:12]}")
    options = parser.parse_args()
    passes = []
    if options.mode in ("both", "uncached"):
        passes.append(asyncio.run(one_pass(options.group_size, None)))
    if options.mode in ("both", "cached"):
        for _ in range(options.passes):
            passes.append(asyncio.run(one_pass(options.group_size, options.task_id)))
        client = _shared.shared_client()
        stats = client.stats(options.task_id)
        _shared.close_clients()
    else:
        stats = None
    for number, done in enumerate(passes):
        print(
            f"pass {number} ({done['mode']}): wall {done['wall_ms']:.0f} ms, tool {done['tool_ms']:.0f} ms, "
            f"ran {done['ran']}, executors {done.get('executor', {})}",
            file=sys.stderr,
        )
    json.dump(
        {"framework": "tinker-cookbook 0.6.1", "task_id": options.task_id, "passes": passes, "service_stats": stats},
        sys.stdout,
    )
    sys.stdout.write("\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
