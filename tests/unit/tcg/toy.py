"""A toy deterministic environment with read and write tools, for the core's property tests."""

from __future__ import annotations

import copy

from cache.tcg import TaskPolicy, ToolCall, ToolPolicy

POLICY = TaskPolicy(tools={"read": ToolPolicy(mutates_state=False), "keys": ToolPolicy(mutates_state=False)})


class ToyEnvironment:
    def __init__(self) -> None:
        self.state: dict[str, str] = {}
        self.executions = 0

    def execute(self, call: ToolCall) -> dict:
        self.executions += 1
        key, value = call.args.get("key"), call.args.get("value")
        if call.tool == "write":
            self.state[key] = value
            return {"ok": True}
        if call.tool == "append":
            self.state[key] = self.state.get(key, "") + value
            return {"length": len(self.state[key])}
        if call.tool == "read":
            return {"value": self.state.get(key)}
        if call.tool == "keys":
            return {"keys": sorted(self.state)}
        raise ValueError(call.tool)

    def fork(self) -> ToyEnvironment:
        twin = ToyEnvironment()
        twin.state = copy.deepcopy(self.state)
        return twin


def fresh_result(history: list[ToolCall], call: ToolCall) -> dict:
    env = ToyEnvironment()
    for past in history:
        env.execute(past)
    return env.execute(call)
