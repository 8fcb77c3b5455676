"""veRL 0.9.1's ToolAgentLoop over tools built from a tool config, uncached and through tvcache.

Runs in the verl venv (lab/frameworks/specs/verl.txt) against a served tvcache (TVCACHE_URL,
TVCACHE_TOKEN) and prints one JSON document. Everything but the model is veRL's own: the tools
are built by `load_all_tools` (a tool config YAML through `initialize_tools_from_config`, the
function tools through `function_tool_path`), the agent loop by `hydra.utils.instantiate` as
AgentLoopWorker builds it, and each trajectory is `ToolAgentLoop.run`, which calls tools through
`_call_tool` with its real `AgentData`. The model is scripted: a tokenizer made here (byte-level,
with a chat template) and a server that answers each turn's text from a script.

Passes: `uncached` (the tools as configured), then `first` and `repeat` through tvcache, the tool
config changed only as docs/integrations/verl.md says. Each trajectory's observations are kept:
each `_call_tool` answer (the ToolResponse, reward and metrics, by repr and type), the
`calc_reward` of each answer instance (scored before its release, as a user's loop would), and
the AgentLoopOutput (token ids, masks, turns, extra_fields, the decoded response).

    python verl_rollouts.py --passes uncached,first,repeat --samples 3 --rollouts 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import gc
import json
import os
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import hydra
import verl_tools
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop  # noqa: F401 - registers "tool_agent"
from verl.tools.tool_registry import load_all_tools
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

HERE = Path(__file__).resolve().parent
FUNCTIONS = HERE / "verl_functions.py"

# The tools as a user configures them (the uncached pass); tvcache_tool_config() makes the
# one change the docs describe.
TOOLS = [
    ("verl_tools.SearchTool", "search", {"query": "string"}, {}),
    ("verl_tools.NotesTool", "note", {"text": "string"}, {}),
    ("verl_tools.AnswerTool", "answer", {"answer": "string"}, {}),
    ("verl_tools.StatsTool", "stats", {"values": "array"}, {"tvcache_read_only": True}),
]
FUNCTION_TOOLS = [("lookup", {"tvcache_read_only": True})]

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}{% endif %}"
    "{%- if message.tool_calls %}{% for call in message.tool_calls %}"
    "<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tool_config(tvcache: bool, task_key: str = "task") -> dict[str, Any]:
    tools = []
    for class_path, name, properties, options in TOOLS:
        schema = {
            "type": "function",
            "function": {
                "name": name,
                "description": f"The {name} tool.",
                "parameters": {
                    "type": "object",
                    "properties": {key: {"type": kind, "description": key} for key, kind in properties.items()},
                    "required": list(properties),
                },
            },
        }
        config: dict[str, Any] = {"type": "native"}
        entry = {"class_name": class_path, "config": config, "tool_schema": schema}
        if tvcache:
            entry["class_name"] = "tvclient.integrations.verl.TVCacheTool"
            config.update(wrapped_class=class_path, tvcache_task_key=task_key, **options)
        tools.append(entry)
    if tvcache:  # the function tools move from function_tool_path into the tool config
        for name, options in FUNCTION_TOOLS:
            tools.append(
                {
                    "class_name": "tvclient.integrations.verl.TVCacheTool",
                    "config": {
                        "type": "native",
                        "wrapped_function": f"{FUNCTIONS}:{name}",
                        "tvcache_task_key": task_key,
                        **options,
                    },
                }
            )
    return {"tools": tools}


def tokenizer() -> Any:
    """A byte-level tokenizer with a ChatML template, made here (no model hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    model = Tokenizer(models.BPE(vocab={char: index for index, char in enumerate(alphabet)}, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=model, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def tool_call(name: str, **arguments: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def script(sample: int, rollout: int) -> list[str]:
    """The model's turns for one trajectory. Rollouts of a sample agree on their first turns;
    odd rollouts then diverge (a miss after hits: the rollout's sandbox replays its history)."""
    word = ["alpha", "kiwi", "umbrella", "zed"][sample % 4]
    # stats answers what cannot be cached: it runs every time, and first, so that its sandbox
    # has nothing to replay (a later one would make the repeat pass replay the calls before it).
    turns = [
        "Let me look."
        + tool_call("stats", values=[1, 2, sample + 3])
        + tool_call("search", query=word)
        + tool_call("lookup", word=word),
        tool_call("note", text=f"{word} seen") + tool_call("search", query=word + "s"),
    ]
    if rollout % 2:
        turns.append(tool_call("note", text="second thoughts") + tool_call("search", query="other"))
        turns.append(tool_call("answer", answer="7"))
    else:
        turns.append(tool_call("answer", answer=str(40 + sample)))
    return turns + [f"The answer is {40 + sample}."]


class ScriptedModel:
    """The LLM server's place (AsyncLLMServerManager.generate): each turn's text from script()."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> TokenOutput:
        text = self.tokenizer.decode(prompt_ids)
        sample, rollout = map(int, re.search(r"sample=(\d+) rollout=(\d+)", text).groups())
        turn = text.count("<|im_start|>assistant") - 1
        ids = self.tokenizer.encode(script(sample, rollout)[turn], add_special_tokens=False)
        ids.append(self.tokenizer.eos_token_id)
        # A key of the framework's own, as rollout servers answer them.
        return TokenOutput(token_ids=ids, extra_fields={"max_global_steps": 3})


# What one trajectory observed, filled by the observers below.
observed: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("observed")


def observe_calls(agent_loop: Any) -> None:
    """Keep each `_call_tool` answer, in the order the calls were made."""
    call_tool = agent_loop._call_tool

    async def keep(tool_call: Any, tools_kwargs: dict[str, Any], agent_data: Any) -> Any:
        slot = len(observed.get()["calls"])
        observed.get()["calls"].append(None)
        response, reward, metrics = await call_tool(tool_call, tools_kwargs, agent_data)
        observed.get()["calls"][slot] = [
            tool_call.name,
            repr(response),
            repr(reward),
            type(reward).__name__,
            repr(metrics),
        ]
        return response, reward, metrics

    agent_loop._call_tool = keep


def score_before_release(tools: list[Any]) -> None:
    """A user's scoring hook: the answer tool's calc_reward of each instance, before its release."""
    for tool in tools:
        if tool.name != "answer":
            continue
        release = tool.release

        async def scored(instance_id: str, __release: Any = release, __tool: Any = tool, **kwargs: Any) -> None:
            kept = observed.get(None)
            if kept is not None:  # in an agent loop's trajectory
                tools_kwargs = kept["tools_kwargs"].get("answer", {})
                reward = await __tool.calc_reward(instance_id, **tools_kwargs.get("calc_reward_kwargs", {}))
                kept["calc_reward"].append([repr(reward), type(reward).__name__])
            await __release(instance_id, **kwargs)

        tool.release = scored


def build_tools(mode: str, workdir: Path) -> list[Any]:
    """The tools as AgentLoopWorker loads them: load_all_tools(tool_config_path, function_tool_path)."""
    path = workdir / f"tools-{mode}.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(tool_config(tvcache=mode != "uncached"))))
    tools = load_all_tools(
        tool_config_path=str(path), function_tool_path=str(FUNCTIONS) if mode == "uncached" else None
    )
    score_before_release(tools)
    return tools


def agent_loop(tools: list[Any], model: ScriptedModel) -> Any:
    """A ToolAgentLoop as AgentLoopWorker._run_agent_loop instantiates one."""
    config = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "prompt_length": 16384,
                    "response_length": 16384,
                    "full_determinism": False,
                    "multi_turn": {
                        "max_user_turns": 8,
                        "max_assistant_turns": 8,
                        "max_parallel_calls": 4,
                        "max_tool_response_length": 4096,
                        "tool_response_truncate_side": "middle",
                        "format": "hermes",
                    },
                }
            },
            "data": {"apply_chat_template_kwargs": {}},
        }
    )
    loop = hydra.utils.instantiate(
        config=_agent_loop_registry["tool_agent"],
        trainer_config=DictConfigWrap(config=config),
        server_manager=model,
        tokenizer=model.tokenizer,
        processor=None,
        hf_model_type=None,
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(config.data),
        tools=ToolListWrap(tools),
    )
    observe_calls(loop)
    return loop


async def trajectory(tools: list[Any], model: ScriptedModel, task: str, sample: int, rollout: int) -> dict[str, Any]:
    tools_kwargs = {
        "search": {"create_kwargs": {"task": task}},
        "answer": {"create_kwargs": {"ground_truth": str(40 + sample)}, "calc_reward_kwargs": {"scale": 2.0}},
    }
    observed.set({"calls": [], "calc_reward": [], "tools_kwargs": tools_kwargs})
    output = await agent_loop(tools, model).run(
        {"temperature": 1.0},
        raw_prompt=[{"role": "user", "content": f"sample={sample} rollout={rollout}"}],
        tools_kwargs=tools_kwargs,
    )
    kept = observed.get()
    return {
        "sample": sample,
        "rollout": rollout,
        "calls": kept["calls"],
        "calc_reward": kept["calc_reward"],
        "extra_fields": repr(output.extra_fields),
        "prompt_ids": output.prompt_ids,
        "response_ids": output.response_ids,
        "response_mask": output.response_mask,
        "num_turns": output.num_turns,
        "response": model.tokenizer.decode(output.response_ids),
    }


async def kept_instance(tools: list[Any], task: str) -> list[list[str]]:
    """A loop that keeps one instance for a whole trajectory and passes no agent_data (veRL's
    older loops): two answers to one AnswerTool instance, scored after each."""
    tool = next(tool for tool in tools if tool.name == "answer")
    instance_id, _ = await tool.create(create_kwargs={"ground_truth": "41", "task": task})
    seen = []
    for answer in ("40", "41"):
        response, reward, metrics = await tool.execute(instance_id, {"answer": answer})
        score = await tool.calc_reward(instance_id)
        seen.append([repr(response), repr(reward), repr(metrics), repr(score), type(score).__name__])
    await tool.release(instance_id)
    return seen


async def run_pass(mode: str, args: argparse.Namespace, workdir: Path, model: ScriptedModel) -> dict[str, Any]:
    tools = build_tools(mode, workdir)
    executed_before = dict(verl_tools.EXECUTED)
    seconds_before = dict(verl_tools.TOOL_SECONDS)
    started = time.perf_counter()
    trajectories = await asyncio.gather(
        *(
            trajectory(tools, model, f"{args.task_prefix}-{sample}", sample, rollout)
            for sample in range(args.samples)
            for rollout in range(args.rollouts)
        )
    )
    wall_s = time.perf_counter() - started
    instances = [await kept_instance(tools, f"{args.task_prefix}-kept-{index}") for index in range(2)]
    gc.collect()  # the trajectories' AgentData is gone: their rollouts end
    await asyncio.sleep(0)
    return {
        "trajectories": trajectories,
        "kept_instances": instances,
        "executed": {name: count - executed_before.get(name, 0) for name, count in verl_tools.EXECUTED.items()},
        "tool_s": sum(verl_tools.TOOL_SECONDS.values()) - sum(seconds_before.values()),
        "wall_s": wall_s,
    }


def service_stats(task_prefix: str, samples: int) -> dict[str, Any]:
    from tvclient import TVCacheError
    from tvclient.integrations import _shared

    client = _shared.shared_client()
    totals: dict[str, Any] = {}
    for sample in range(samples):
        try:
            stats = client.stats(f"{task_prefix}-{sample}")
        except TVCacheError as exc:
            if exc.code != "unknown_task":  # not registered yet: no call of it so far
                raise
            continue
        for key, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                totals[key] = totals.get(key, 0) + value
    return totals


async def refusals(workdir: Path, model: ScriptedModel, task: str) -> dict[str, str]:
    """What tvcache refuses rather than answer with another trajectory: a wrapped_class that
    names a function tool (when veRL builds the tools), and a read-only tool that writes
    extra_fields (at its call, out of ToolAgentLoop.run)."""
    from tvclient.integrations.verl import SideEffectNotKept

    refused: dict[str, str] = {}
    config = tool_config(tvcache=True)
    config["tools"][-1]["config"] = {"type": "native", "wrapped_class": f"{FUNCTIONS}:lookup"}
    path = workdir / "tools-function-as-class.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    try:
        load_all_tools(tool_config_path=str(path), function_tool_path=None)
    except TypeError as exc:
        refused["function_as_class"] = str(exc)
    config = tool_config(tvcache=True)
    config["tools"][0]["config"]["tvcache_read_only"] = True  # search writes extra_fields
    path = workdir / "tools-misdeclared.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    tools = load_all_tools(tool_config_path=str(path), function_tool_path=None)
    try:
        await trajectory(tools, model, task, 0, 0)
    except SideEffectNotKept as exc:
        refused["read_only_writes_extra_fields"] = str(exc)
    return refused


async def main(args: argparse.Namespace) -> dict[str, Any]:
    model = ScriptedModel(tokenizer())
    passes = {}
    with tempfile.TemporaryDirectory() as workdir:
        for mode in args.passes.split(","):
            stats_before = service_stats(args.task_prefix, args.samples) if mode != "uncached" else {}
            result = await run_pass(mode, args, Path(workdir), model)
            if mode != "uncached":
                await asyncio.sleep(0.2)  # the rollouts' ends (and last records) on their way
                after = service_stats(args.task_prefix, args.samples)
                service = {
                    key: after.get(key, 0) - stats_before.get(key, 0)
                    for key in ("calls", "hits", "executions", "executed_ms", "saved_ms")
                }
                result["service"] = {**service, "misses": service["calls"] - service["hits"]}
            passes[mode] = result
        document: dict[str, Any] = {"verl": _version(), "passes": passes}
        if any(mode != "uncached" for mode in passes):
            from tvclient.integrations import verl as integration

            document["trajectories_open"] = len(integration._by_agent_data) + len(integration._by_instance)
            document["refused"] = await refusals(Path(workdir), model, f"{args.task_prefix}-refused")
    return document


def _version() -> str:
    from importlib.metadata import version

    return version("verl")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--passes",
        default="uncached,first,repeat",
        help="uncached: the tools as configured; any other name: through tvcache",
    )
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--task-prefix", default=f"verl-{uuid.uuid4().hex[:8]}")
    return parser.parse_args()


if __name__ == "__main__":
    os.environ.setdefault("VERL_LOGGING_LEVEL", "ERROR")
    document, sys.stdout = sys.stdout, sys.stderr  # BaseTool prints each tool's schema
    document.write(json.dumps(asyncio.run(main(parse()))) + "\n")
