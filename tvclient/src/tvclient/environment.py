"""The interface a trainer implements for the sandboxes it owns (client mode)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from .results import Call, ToolResult


class ToolExecutionEnvironment(ABC):
    """One sandbox: executes tool calls and can be forked in its current state.

    The cache is only correct if `execute` depends on nothing but the sandbox state and the
    call, and if `mutates_state` answers False only for calls that truly change nothing.
    """

    # Sent with every snapshot this environment registers; the service keeps snapshot and
    # restore costs per backend.
    backend: str = "external"

    @abstractmethod
    def start(self) -> None:
        """Bring up a fresh sandbox in the task's initial state."""

    @abstractmethod
    def execute(self, call: Call) -> ToolResult:
        """Run one call and return its JSON-serialisable result."""

    def execute_observed(self, call: Call) -> tuple[ToolResult, bool | None]:
        """`execute`, and whether the call changed the sandbox where the environment can tell.

        Override it when the sandbox can see its own changes (a filesystem diff, a database's
        change counter): False records the call as read-only, so that later calls of any
        rollout match without it. None (the default) leaves it to `mutates_state`. Answer False
        only when nothing at all changed.
        """
        return self.execute(call), None

    @abstractmethod
    def fork(self) -> ToolExecutionEnvironment:
        """A new, started, independent environment in this one's current state."""

    @abstractmethod
    def stop(self) -> None:
        """Free the sandbox; the environment is not used again."""

    def mutates_state(self, call: Call) -> bool:
        # Assuming every call writes is always safe; override to declare read-only tools.
        return True
