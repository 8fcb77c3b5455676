"""The one sandbox interface (docs/design/sandboxes.md): pools and forking are written against it.

Backends never import Django: their configuration comes in as frozen dataclasses
(`sandboxes.backends.config`), so they run the same in the service, in Celery workers and in tests.
"""

from __future__ import annotations

import datetime as dt
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .hostfs import StateDigest

# Every container, image, folder and file a backend creates carries this label, so reapers can
# tell what is ours from whatever else shares the engine or the disk.
OWNER_LABEL = "tvcache.owner"
OWNER = "tvcache"
# On snapshots: the sandbox they were taken from.
SOURCE_LABEL = "tvcache.source"


class SandboxError(Exception):
    """Base of every backend error; `code` is stable and reaches the API's error JSON."""

    code = "sandbox_error"

    def __init__(self, message: str, *, details: Any = None):
        super().__init__(message)
        self.message = message
        self.details = details


class ToolNotFound(SandboxError):
    code = "unknown_tool"


class InvalidToolArgs(SandboxError):
    code = "invalid_tool_args"


class InvalidEnv(SandboxError):
    """The task's env spec cannot be served by this backend (bad field, missing image)."""

    code = "invalid_env"


class SandboxGone(SandboxError):
    """The sandbox died (or was removed) before or during a call."""

    code = "sandbox_gone"


class EngineUnavailable(SandboxError):
    code = "engine_unavailable"


class EngineUnreachable(EngineUnavailable):
    """The engine could not be reached before the call started: the call did not run, and the
    sandbox is as it was (if it outlives the engine's restart)."""


class SandboxTampered(SandboxError):
    """The sandbox replaced files the service keeps in it (the shell session's) with links, FIFOs
    or devices: it is retired, never read through."""

    code = "sandbox_tampered"


class SnapshotMissing(SandboxError):
    code = "snapshot_missing"


class NotGranted(InvalidEnv):
    """The env spec asks for more than the operator allows (settings); the trainer cannot widen it."""

    code = "not_granted"


class LimitExceeded(NotGranted):
    """A limit above the operator's maximum, or a seed larger than the sandbox may hold."""

    code = "limit_exceeded"


class ImageNotAllowed(NotGranted):
    code = "image_not_allowed"


class NetworkNotGranted(NotGranted):
    code = "network_not_granted"


class UserNotAllowed(NotGranted):
    code = "user_not_allowed"


class PathTooLong(InvalidToolArgs):
    code = "path_too_long"


class DiskQuotaExceeded(SandboxError):
    """A call would take the sandbox past its disk allowance (or the disk is full); it was
    refused before it changed anything."""

    code = "disk_quota_exceeded"


class SandboxOverQuota(DiskQuotaExceeded, SandboxGone):
    """The sandbox went past its disk allowance during a call: it was removed, or its state is
    unknown. A SandboxGone: the rollout's next call gets a new sandbox."""

    code = "disk_quota_exceeded"


@dataclass(frozen=True)
class ToolSpec:
    """A tool's caching policy. The safe default: it mutates state and its results are cacheable."""

    mutates_state: bool = True
    cacheable: bool = True


@dataclass(frozen=True)
class SnapshotInfo:
    ref: str
    size_bytes: int
    create_ms: float
    # The snapshot holds the sandbox's processes and their memory (a checkpoint), not only its
    # files: a fork of it comes up with them running.
    keeps_processes: bool = False


@dataclass(frozen=True)
class OwnedResource:
    """A sandbox or snapshot that a backend created, as listed for reaping."""

    id: str
    labels: Mapping[str, str] = field(default_factory=dict)
    created_at: dt.datetime | None = None  # timezone-aware UTC


class Sandbox(ABC):
    """One running sandbox. Calls on one sandbox are serialized by the sandbox itself."""

    sandbox_id: str
    # Its snapshots hold its live processes and their memory (SnapshotInfo.keeps_processes). A
    # snapshot that does not is never taken of, nor forked for, a state with live processes
    # (docs/design/state.md).
    keeps_processes: bool = False

    @abstractmethod
    def execute(self, tool: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """Run one built-in tool call and return its JSON result.

        Raises ToolNotFound, InvalidToolArgs, SandboxGone, EngineUnavailable. A tool that fails
        in a way the agent should see (a missing file, bad SQL, a non-zero exit) returns a result.
        """

    def execute_observed(self, tool: str, args: Mapping[str, Any]) -> tuple[dict[str, Any], bool | None]:
        """`execute`, and whether the call changed the sandbox's state where the backend can
        tell: False only when nothing changed. None: not observed, the tool's declaration holds."""
        return self.execute(tool, args), None

    def state_fingerprint(self) -> StateDigest | None:
        """Digests of the sandbox's state that another sandbox matches only in the same state
        (hostfs.StateDigest: in full for a fork, in shape for a replay). None where the backend
        cannot tell: nothing is then verified against it."""
        return None

    def observed_ms(self) -> float:
        """How long, in all, the sandbox has spent observing the processes it keeps running (ms):
        the service's timings set it apart from the calls'."""
        return 0.0

    def state_drifted(self) -> bool:
        """Whether, before its last observed call, the sandbox's state had changed on its own since
        the call before it ended (a process it left running wrote files, or started or ended): the
        state that call left depended on timing. False where the backend cannot tell."""
        return False

    def restore_file_times(self, times: Mapping[str, int]) -> None:
        """Give the paths the modification times (ns) a live run of a call left them
        (StateDigest.times), after a replay of that call. Backends whose tools never see file
        times have nothing to do."""

    @abstractmethod
    def snapshot(self, *, labels: Mapping[str, str] | None = None) -> SnapshotInfo:
        """Freeze the current state into an immutable snapshot; the sandbox keeps running."""

    @abstractmethod
    def stop(self) -> None:
        """Free the sandbox. Idempotent."""

    @abstractmethod
    def alive(self) -> bool: ...

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class SandboxBackend(ABC):
    name: str
    # The built-in tools and their default policy; a task's own tool declarations override it.
    tools: Mapping[str, ToolSpec]

    @abstractmethod
    def start(self, env: Mapping[str, Any], *, labels: Mapping[str, str]) -> Sandbox:
        """A fresh sandbox in the task's initial state."""

    @abstractmethod
    def fork(self, ref: str, env: Mapping[str, Any], *, labels: Mapping[str, str]) -> Sandbox:
        """A new sandbox in the state of snapshot `ref`. Raises SnapshotMissing."""

    @abstractmethod
    def attach(self, sandbox_id: str) -> Sandbox:
        """The running sandbox `sandbox_id`, as started or forked by any process of this host.
        Raises SandboxGone when it no longer exists."""

    @abstractmethod
    def delete_snapshot(self, ref: str) -> None:
        """Drop a snapshot. Idempotent; sandboxes already forked from it keep running."""

    @abstractmethod
    def fingerprint_material(self, env: Mapping[str, Any]) -> dict[str, Any]:
        """Facts beyond the env spec that decide tool results (image id, seed hash, versions).

        They go into the task's env fingerprint, so a rebuilt image or a changed tool
        implementation can never hit results computed in the old environment.
        """

    @abstractmethod
    def health(self) -> dict[str, Any]:
        """{"ok": bool, ...backend facts}; never raises."""

    @abstractmethod
    def list_sandboxes(self, label_selector: Mapping[str, str] | None = None) -> list[OwnedResource]:
        """Our sandboxes whose labels include every key=value of the selector."""

    @abstractmethod
    def list_snapshots(self, label_selector: Mapping[str, str] | None = None) -> list[OwnedResource]:
        """Our snapshots whose labels include every key=value of the selector; ids are refs."""

    @abstractmethod
    def remove_sandbox(self, sandbox_id: str) -> None:
        """Stop and remove a sandbox by id, including one another process started. Idempotent."""

    def audit_view(self, tool: str, result: Mapping[str, Any]) -> Any:
        """What the determinism audit compares of a call's result (the recorded one and a
        re-execution's); None when this result proves nothing either way. The whole result,
        unless a backend knows better."""
        return result

    def tool_spec(self, tool: str) -> ToolSpec:
        try:
            return self.tools[tool]
        except KeyError:
            raise ToolNotFound(
                f"{self.name} sandboxes have no tool {tool!r}", details={"tools": sorted(self.tools)}
            ) from None


def require_str(args: Mapping[str, Any], key: str) -> str:
    """Tool argument validation shared by the backends."""
    if not isinstance(args, Mapping):
        raise InvalidToolArgs("tool args must be a JSON object")
    value = args.get(key)
    if not isinstance(value, str):
        raise InvalidToolArgs(f"{key!r} must be a string", details={"field": key})
    return value


def check_env_keys(env: Mapping[str, Any], allowed: frozenset[str]) -> None:
    """Unknown fields are refused: a typo ("netwrok") must not silently run a different sandbox."""
    if not isinstance(env, Mapping):
        raise InvalidEnv("the env spec must be a JSON object")
    unknown = set(env) - allowed
    if unknown:
        raise InvalidEnv(f"unknown env fields: {sorted(unknown)}", details={"allowed": sorted(allowed)})


def check_labels(labels: Mapping[str, str]) -> dict[str, str]:
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise TypeError("labels must map strings to strings")
    return dict(labels)


def labels_match(labels: Mapping[str, str], selector: Mapping[str, str] | None) -> bool:
    return all(labels.get(k) == v for k, v in (selector or {}).items())
