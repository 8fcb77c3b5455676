"""The tools of the veRL driver (verl_rollouts.py), written as veRL users write theirs.

- `SearchTool` keeps the trajectory's queries in `agent_data.extra_fields`, as veRL's AgentData
  asks tools to keep session data, and answers metrics whose keys are not sorted.
- `NotesTool` keeps notes by the agent loop's request id: state outside the AgentData, which a
  rollout's sandbox rebuilds by replaying.
- `AnswerTool` is a stateful tool in the GSM8K style: `execute` stores the answer in its
  instance, `calc_reward` scores it from there.
- `StatsTool` answers a numpy float in its metrics: not exact JSON, so it always runs.
- `verl_functions.py` holds the `@function_tool` functions.

`EXECUTED` counts the calls each tool really ran in this process (live or replayed).
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from typing import Any

import numpy as np
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

EXECUTED: Counter[str] = Counter()
TOOL_SECONDS: Counter[str] = Counter()  # time spent in the tools, by tool
SESSIONS: dict[str, list[str]] = {}


def _ran(name: str, started: float) -> None:
    EXECUTED[name] += 1
    TOOL_SECONDS[name] += time.perf_counter() - started


class SearchTool(BaseTool):
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        started = time.perf_counter()
        queries = kwargs["agent_data"].extra_fields.setdefault("queries", [])
        queries.append(parameters["query"])
        text = f"{len(queries)} queries so far; top hit for {parameters['query']!r}: doc-{len(parameters['query'])}"
        _ran("search", started)
        return ToolResponse(text=text), 0.0, {"zeta": len(queries), "alpha": parameters["query"]}


class NotesTool(BaseTool):
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        started = time.perf_counter()
        notes = SESSIONS.setdefault(kwargs["agent_data"].request_id, [])
        notes.append(parameters["text"])
        _ran("note", started)
        return ToolResponse(text=" | ".join(notes)), 0.0, {}


class AnswerTool(BaseTool):
    def __init__(self, config: dict, tool_schema: Any) -> None:
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, **kwargs: Any):
        instance_id = instance_id or str(uuid.uuid4())
        truth = kwargs["create_kwargs"]["ground_truth"]
        self._instances[instance_id] = {"truth": truth, "answer": None}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        started = time.perf_counter()
        self._instances[instance_id]["answer"] = str(parameters["answer"])
        _ran("answer", started)
        return ToolResponse(text=f"answer {parameters['answer']} submitted"), 0.1, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        instance = self._instances[instance_id]
        return kwargs.get("scale", 1.0) * float(instance["answer"] == instance["truth"])

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        del self._instances[instance_id]


class StatsTool(BaseTool):
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        started = time.perf_counter()
        values = np.array([float(v) for v in parameters["values"]])
        _ran("stats", started)
        return ToolResponse(text=f"mean {values.mean():.3f}"), 0.0, {"mean": values.mean()}
