"""Per-tool declarations. The defaults are the safe ones: every tool mutates state and is cacheable."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    mutates_state: bool = True
    cacheable: bool = True

    def changes_state(self, observed: bool | None = None) -> bool:
        """Whether a call of this tool changed the state: as declared, unless its sandbox observed
        that it changed nothing (`observed` False; None: not observed)."""
        return self.mutates_state and observed is not False


DEFAULT_TOOL_POLICY = ToolPolicy()


@dataclass(frozen=True)
class TaskPolicy:
    tools: Mapping[str, ToolPolicy] = field(default_factory=dict)

    def for_tool(self, tool: str) -> ToolPolicy:
        return self.tools.get(tool, DEFAULT_TOOL_POLICY)

    @classmethod
    def from_json(cls, data: Mapping[str, Mapping[str, Any]]) -> TaskPolicy:
        return cls(tools={name: ToolPolicy(**spec) for name, spec in data.items()})
