"""The directory backend: a folder per sandbox, tools are Python functions over it (never a shell).

Snapshot and fork are full copies of the folder. Hard links would be cheaper but unsafe: a
write in place in the fork would show through in the snapshot.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from . import hostfs
from .base import (
    SOURCE_LABEL,
    DiskQuotaExceeded,
    InvalidEnv,
    LimitExceeded,
    OwnedResource,
    PathTooLong,
    Sandbox,
    SandboxBackend,
    SandboxGone,
    SandboxOverQuota,
    SnapshotInfo,
    SnapshotMissing,
    ToolSpec,
    check_env_keys,
    check_labels,
    require_str,
)
from .config import DirectoryConfig
from .folders import FolderStore, disk_errors, folder_size, tree_usage
from .patch import PatchRejected, plan_patch

# Bump when a tool's behaviour changes: it is part of the env fingerprint.
TOOLS_VERSION = 1
_FILES = "files"
_ENV_KEYS = frozenset({"backend", "files"})
# Paths are refused past these lengths whatever the host's own limits and root folder are, so the
# same call is refused (or not) on every host.
_MAX_NAME_BYTES = 255
_MAX_PATH_BYTES = 1024


class PathEscape(Exception):
    """A tool path that would leave the sandbox folder."""


def confine(root: Path, relpath: str) -> Path:
    """`relpath` resolved inside `root` (itself fully resolved); raises PathEscape otherwise."""
    parts = PurePosixPath(relpath).parts
    if "\x00" in relpath or relpath.startswith("/") or ".." in parts:
        raise PathEscape(f"path must be relative and stay inside the sandbox: {relpath!r}")
    check_path_length(relpath)
    target = root.joinpath(*parts)
    # Symlinks cannot be made by the tools, but a seed or a fork source might hold one.
    real = Path(os.path.realpath(target))
    if real != root and root not in real.parents:
        raise PathEscape(f"path leads outside the sandbox: {relpath!r}")
    return target


def check_path_length(relpath: str) -> None:
    encoded = relpath.encode("utf-8", "surrogatepass")
    if len(encoded) > _MAX_PATH_BYTES or any(len(part) > _MAX_NAME_BYTES for part in encoded.split(b"/")):
        raise PathTooLong(
            f"paths are limited to {_MAX_PATH_BYTES} bytes and names to {_MAX_NAME_BYTES} bytes",
            details={"path": relpath[:100]},
        )


def _check_room(root: Path, config: DirectoryConfig, grows: int) -> None:
    """Refuses, before anything is written, a change that would take the sandbox past its size."""
    if grows <= 0:
        return
    held = tree_usage(root, stop_bytes=config.max_total_bytes).bytes
    if held + grows > config.max_total_bytes:
        raise DiskQuotaExceeded(
            f"the sandbox's files may take {config.max_total_bytes} bytes in all",
            details={"held_bytes": held, "adding_bytes": grows, "max_bytes": config.max_total_bytes},
        )


def _file_size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def _result(output: str, ok: bool = True) -> dict[str, Any]:
    return {"output": output, "ok": ok}


def _read_file(root: Path, args: Mapping[str, Any], config: DirectoryConfig) -> dict[str, Any]:
    path = confine(root, require_str(args, "path"))
    if not path.is_file():
        return _result(f"no such file: {args['path']}", ok=False)
    if path.stat().st_size > config.max_read_bytes:
        return _result(f"file is larger than {config.max_read_bytes} bytes: {args['path']}", ok=False)
    return _result(path.read_bytes().decode("utf-8", errors="replace"))


def _write_file(root: Path, args: Mapping[str, Any], config: DirectoryConfig) -> dict[str, Any]:
    path = confine(root, require_str(args, "path"))
    data = require_str(args, "content").encode("utf-8")
    if len(data) > config.max_write_bytes:
        return _result(f"content is larger than {config.max_write_bytes} bytes", ok=False)
    blocked = _unwritable(root, path)
    if blocked:
        return _result(blocked, ok=False)
    _check_room(root, config, len(data) - _file_size(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return _result(f"wrote {len(data)} bytes to {args['path']}")


def _list_dir(root: Path, args: Mapping[str, Any], config: DirectoryConfig) -> dict[str, Any]:
    path = confine(root, require_str(args, "path"))
    if not path.is_dir():
        return _result(f"no such directory: {args['path']}", ok=False)
    names = sorted(entry.name + ("/" if entry.is_dir(follow_symlinks=False) else "") for entry in os.scandir(path))
    return _result("\n".join(names))


def _apply_patch(root: Path, args: Mapping[str, Any], config: DirectoryConfig) -> dict[str, Any]:
    def read(relpath: str) -> str | None:
        path = confine(root, relpath)
        return path.read_bytes().decode("utf-8") if path.is_file() else None

    try:
        changes = plan_patch(require_str(args, "patch"), read)
    except (PatchRejected, UnicodeDecodeError) as exc:
        return _result(f"patch rejected, nothing changed: {exc}", ok=False)
    targets = [(confine(root, change.path), change) for change in changes]
    blocked = [reason for path, change in targets if change.content is not None and (reason := _unwritable(root, path))]
    if blocked:
        return _result(f"patch rejected, nothing changed: {blocked[0]}", ok=False)
    written = sum(len(change.content.encode("utf-8")) for _, change in targets if change.content is not None)
    _check_room(root, config, written - sum(_file_size(path) for path, _ in targets))
    for path, change in targets:
        if change.content is None:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(change.content.encode("utf-8"))
    return _result("\n".join(f"{change.action} {change.path}" for change in changes))


def _unwritable(root: Path, path: Path) -> str | None:
    """Why a regular file cannot be written at `path`, checked before anything is written."""
    if path == root or path.is_dir():
        return f"is a directory: {path.relative_to(root)}"
    for parent in path.relative_to(root).parents:
        if (root / parent).exists() and not (root / parent).is_dir():
            return f"not a directory: {parent}"
    return None


DirectoryTool = Callable[[Path, Mapping[str, Any], DirectoryConfig], dict[str, Any]]
_TOOLS: dict[str, tuple[DirectoryTool, ToolSpec]] = {
    "read_file": (_read_file, ToolSpec(mutates_state=False)),
    "write_file": (_write_file, ToolSpec(mutates_state=True)),
    "list_dir": (_list_dir, ToolSpec(mutates_state=False)),
    "apply_patch": (_apply_patch, ToolSpec(mutates_state=True)),
}


def _seed_files(env: Mapping[str, Any], config: DirectoryConfig) -> dict[str, str]:
    check_env_keys(env, _ENV_KEYS)
    files = env.get("files", {})
    if not isinstance(files, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise InvalidEnv('"files" must map relative paths to text contents')
    for relpath in files:
        check_path_length(relpath)
    size = sum(len(content.encode("utf-8", "surrogatepass")) for content in files.values())
    if size > config.max_total_bytes:
        raise LimitExceeded(
            f'"files" hold {size} bytes; a sandbox may hold {config.max_total_bytes}',
            details={"limit": "files", "requested": size, "max": config.max_total_bytes},
        )
    return dict(files)


def _write_seed(folder: Path, files: Mapping[str, str]) -> None:
    folder.mkdir()
    root = Path(os.path.realpath(folder))
    for relpath, content in files.items():
        try:
            path = confine(root, relpath)
        except PathEscape as exc:
            raise InvalidEnv(str(exc)) from None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode("utf-8"))


_FINGERPRINT_MAX_BYTES = 256 << 20
_FINGERPRINT_MAX_ENTRIES = 100_000


class DirectorySandbox(Sandbox):
    def __init__(self, backend: DirectoryBackend, sandbox_id: str, folder: Path):
        self.sandbox_id = sandbox_id
        self._backend = backend
        self._folder = folder
        self._files = Path(os.path.realpath(folder / _FILES))
        # Serializes calls and snapshots, so a snapshot never copies a half-applied patch.
        self._lock = threading.Lock()

    def execute(self, tool: str, args: Mapping[str, Any]) -> dict[str, Any]:
        self._backend.tool_spec(tool)
        with self._lock:
            return self._run(tool, args)

    def execute_observed(self, tool: str, args: Mapping[str, Any]) -> tuple[dict[str, Any], bool | None]:
        """`execute`, and False for a call of a state-changing tool that changed nothing the tools
        can see (paths and contents): a refused write or patch (every refusal comes before the
        first write), or a write of the content the file already holds. None otherwise."""
        if not self._backend.tool_spec(tool).mutates_state:
            return self.execute(tool, args), None
        with self._lock:
            held = self._content(args.get("path")) if tool == "write_file" else None
            result = self._run(tool, args)
        if not result["ok"] or (held is not None and held == args["content"].encode("utf-8")):
            return result, False
        return result, None

    def _run(self, tool: str, args: Mapping[str, Any]) -> dict[str, Any]:
        self._check_alive()
        try:
            # A full disk mid-write leaves the change half done: the sandbox's state is unknown.
            with disk_errors(full=SandboxOverQuota):
                return _TOOLS[tool][0](self._files, args, self._backend.config)
        except PathEscape as exc:
            return _result(str(exc), ok=False)

    def _content(self, relpath: Any) -> bytes | None:
        """What the file at `relpath` holds, if it is a file a write could leave as it is."""
        try:
            path = confine(self._files, relpath) if isinstance(relpath, str) else None
        except PathEscape:
            return None
        if path is None or not path.is_file() or path.stat().st_size > self._backend.config.max_write_bytes:
            return None
        return path.read_bytes()

    def state_fingerprint(self) -> hostfs.StateDigest | None:
        """Paths, types, modes, sizes and contents of the files (the tools show no file times)."""
        with self._lock:
            self._check_alive()
            fingerprint = hostfs.StateFingerprint(max_bytes=_FINGERPRINT_MAX_BYTES, times=False)
            try:
                fingerprint.add_tree(
                    str(self._files),
                    {path for path, _ in hostfs.walk(str(self._files), max_entries=_FINGERPRINT_MAX_ENTRIES)},
                )
            except hostfs.UnsafeEntry:
                return None
            digests = fingerprint.digests()
            return hostfs.StateDigest(full=digests.full, shape=digests.full)  # contents come from the calls' arguments

    def snapshot(self, *, labels: Mapping[str, str] | None = None) -> SnapshotInfo:
        with self._lock:
            self._check_alive()
            started = time.perf_counter()
            snapshot_labels = {
                **self._backend.sandboxes.labels(self.sandbox_id),
                **check_labels(labels or {}),
                SOURCE_LABEL: self.sandbox_id,
            }
            ref = self._backend.snapshots.create(snapshot_labels, self._copy_into)
            create_ms = (time.perf_counter() - started) * 1000
        return SnapshotInfo(
            ref=ref, size_bytes=folder_size(self._backend.snapshots.root / ref / _FILES), create_ms=create_ms
        )

    def stop(self) -> None:
        self._backend.remove_sandbox(self.sandbox_id)

    def alive(self) -> bool:
        return self._folder.is_dir()

    def _copy_into(self, staging: Path) -> None:
        shutil.copytree(self._files, staging / _FILES, symlinks=True)

    def _check_alive(self) -> None:
        if not self.alive():
            raise SandboxGone(f"directory sandbox {self.sandbox_id} was removed")


class DirectoryBackend(SandboxBackend):
    name = "directory"
    tools = {name: spec for name, (_, spec) in _TOOLS.items()}

    def __init__(self, root: Path, config: DirectoryConfig = DirectoryConfig()):
        self.config = config
        self.sandboxes = FolderStore(root / "sandboxes")
        self.snapshots = FolderStore(root / "snapshots")

    def start(self, env: Mapping[str, Any], *, labels: Mapping[str, str]) -> DirectorySandbox:
        files = _seed_files(env, self.config)
        sandbox_id = self.sandboxes.create(check_labels(labels), lambda staging: _write_seed(staging / _FILES, files))
        return self._open(sandbox_id)

    def fork(self, ref: str, env: Mapping[str, Any], *, labels: Mapping[str, str]) -> DirectorySandbox:
        source = self.snapshots.path(ref)
        if source is None:
            raise SnapshotMissing(f"no directory snapshot {ref!r}")

        def copy(staging: Path) -> None:
            shutil.copytree(source / _FILES, staging / _FILES, symlinks=True)

        return self._open(self.sandboxes.create(check_labels(labels), copy))

    def delete_snapshot(self, ref: str) -> None:
        self.snapshots.remove(ref)

    def fingerprint_material(self, env: Mapping[str, Any]) -> dict[str, Any]:
        _seed_files(env, self.config)
        return {"backend": self.name, "tools_version": TOOLS_VERSION}

    def health(self) -> dict[str, Any]:
        writable = os.access(self.sandboxes.root, os.W_OK) and os.access(self.snapshots.root, os.W_OK)
        return {
            "ok": writable,
            "root": str(self.sandboxes.root.parent),
            "sandboxes": self.sandboxes.count(),
            "snapshots": self.snapshots.count(),
        }

    def list_sandboxes(self, label_selector: Mapping[str, str] | None = None) -> list[OwnedResource]:
        return self.sandboxes.list(label_selector)

    def list_snapshots(self, label_selector: Mapping[str, str] | None = None) -> list[OwnedResource]:
        return self.snapshots.list(label_selector)

    def remove_sandbox(self, sandbox_id: str) -> None:
        self.sandboxes.remove(sandbox_id)

    def attach(self, sandbox_id: str) -> DirectorySandbox:
        if self.sandboxes.path(sandbox_id) is None:
            raise SandboxGone(f"directory sandbox {sandbox_id} does not exist")
        return self._open(sandbox_id)

    def _open(self, sandbox_id: str) -> DirectorySandbox:
        folder = self.sandboxes.path(sandbox_id)
        assert folder is not None  # just created
        return DirectorySandbox(self, sandbox_id, folder)
