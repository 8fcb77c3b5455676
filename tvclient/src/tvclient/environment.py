"""The interface a trainer implements for the sandboxes it owns (client mode)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from .results import Call, ToolResult


class ToolExecutionEnvironment(ABC):
    """One sandbox: executes tool calls and can be forked in its current state.

    The cache is only correct if `execute` depends on nothing but the sandbox state and the
    call, and if `mutates_state` answers False only for calls that truly change nothing.
    """

    # Sent with every snapshot this environment registers; the service keeps snapshot and
    # restore costs per backend.
    backend: str = "external"
    # Whether `fork()` copies the processes alive in the sandbox with their memory (a checkpoint),
    # not only its files. See `live_processes`.
    keeps_processes: bool = False

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

    def file_times(self) -> Mapping[str, int] | None:
        """The modification times (ns since the epoch, by path) of what the last executed call
        changed, where the environment can tell; None (the default) where it cannot.

        Override it, with `restore_file_times`, when tools in the sandbox read file times (make,
        Python's bytecode cache): the executor records them with the call, and a rollout that
        later rebuilds this state by replaying the call writes them back, so that its sandbox
        carries the times of the live run rather than those of a replay a moment long. {}: the
        call changed no entry's time. Paths are strings of at most 4,096 characters without NUL,
        4 MiB in all; at most 20,000 entries are sent (more: none, and a replay restores no times
        from that call on). The executor asks only after a call that changed, or may have
        changed, the state.
        """
        return None

    def restore_file_times(self, times: Mapping[str, int]) -> None:
        """After a replayed call: give the paths the modification times (ns) that the call's live
        run left them (what `file_times` answered there). A path that is not there is skipped.
        The default does nothing (and the executor then does not ask the service for them)."""

    def live_processes(self) -> Sequence[str] | None:
        """The processes alive in the sandbox apart from the environment's own (a server, a
        daemon, a watcher a call left running), each described by what a later call can see of
        it (its command line, say); None (the default) where the environment cannot tell.

        Processes are state: a later call can talk to them. A sandbox forked from a copy of its
        files alone comes up without them, so when this reports some and `keeps_processes` is
        False, the executor takes no snapshot of that state and a rollout that needs it replays
        the calls that started them instead. An environment that cannot tell is trusted as
        before: its snapshots are taken and forked whatever ran in it.
        """
        return None

    @abstractmethod
    def fork(self) -> ToolExecutionEnvironment:
        """A new, started, independent environment in this one's current state."""

    @abstractmethod
    def stop(self) -> None:
        """Free the sandbox; the environment is not used again."""

    def mutates_state(self, call: Call) -> bool:
        # Assuming every call writes is always safe; override to declare read-only tools.
        return True
