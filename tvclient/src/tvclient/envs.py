"""Two ready-made environments: a toy key-value store and a folder of text files."""

from __future__ import annotations

import copy
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from .environment import ToolExecutionEnvironment
from .results import Call, ToolResult


class UnknownTool(ValueError):
    pass


class InMemoryEnvironment(ToolExecutionEnvironment):
    """A key-value store of strings, for examples and tests.

    Tools: get {"key"} and list {} read; set {"key", "value"} and append {"key", "value"}
    write. `executions` counts the calls this instance ran.
    """

    READ_ONLY = frozenset({"get", "list"})

    def __init__(self, data: dict[str, str] | None = None) -> None:
        self._initial = dict(data or {})
        self.data: dict[str, str] = {}
        self.running = False
        self.executions = 0

    def start(self) -> None:
        self.data = copy.deepcopy(self._initial)
        self.running = True

    def execute(self, call: Call) -> ToolResult:
        tools: dict[str, Callable[..., ToolResult]] = {
            "get": self._get,
            "set": self._set,
            "append": self._append,
            "list": self._list,
        }
        if call["tool"] not in tools:
            raise UnknownTool(call["tool"])
        self.executions += 1
        return tools[call["tool"]](**call["args"])

    def execute_observed(self, call: Call) -> tuple[ToolResult, bool | None]:
        before = dict(self.data)
        result = self.execute(call)
        return result, self.data != before

    def fork(self) -> InMemoryEnvironment:
        twin = InMemoryEnvironment(self.data)
        twin.start()
        return twin

    def stop(self) -> None:
        self.data = {}
        self.running = False

    def mutates_state(self, call: Call) -> bool:
        return call["tool"] not in self.READ_ONLY

    def _get(self, key: str) -> ToolResult:
        return {"value": self.data.get(key)}

    def _set(self, key: str, value: str) -> ToolResult:
        self.data[key] = value
        return {"value": value}

    def _append(self, key: str, value: str) -> ToolResult:
        self.data[key] = self.data.get(key, "") + value
        return {"value": self.data[key]}

    def _list(self) -> ToolResult:
        return {"keys": sorted(self.data)}


class FolderEnvironment(ToolExecutionEnvironment):
    """A temporary folder of text files per environment (the "directory" backend's tools).

    Tools: read_file {"path"}, write_file {"path", "content"}, list_dir {"path"}; each
    answers {"output": str, "ok": bool}. Paths are relative to the folder; absolute paths and
    ".." are refused. Folders are created under `root` (the system's temp dir by default).
    `executions` counts the calls this instance ran.
    """

    backend = "directory"
    READ_ONLY = frozenset({"read_file", "list_dir"})

    def __init__(self, seed_files: dict[str, str] | None = None, root: str | Path | None = None):
        self._seed_files = dict(seed_files or {})
        self._root = root
        self.path: Path | None = None
        self.executions = 0

    @property
    def running(self) -> bool:
        return self.path is not None

    def start(self) -> None:
        self.path = self._new_folder()
        for name, content in self._seed_files.items():
            target = self._inside(name)
            if target is None:
                raise ValueError(f"seed file {name!r} is outside the folder")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content, encoding="utf-8")

    def execute(self, call: Call) -> ToolResult:
        tools: dict[str, Callable[..., ToolResult]] = {
            "read_file": self._read_file,
            "write_file": self._write_file,
            "list_dir": self._list_dir,
        }
        if call["tool"] not in tools:
            raise UnknownTool(call["tool"])
        self.executions += 1
        args: dict[str, Any] = call["args"]
        target = self._inside(args["path"])
        if target is None:
            return {"output": f"{args['path']}: outside the sandbox folder", "ok": False}
        try:
            return tools[call["tool"]](target, **args)
        except OSError as exc:
            # Only the relative path and the reason: the folder's own location differs from
            # sandbox to sandbox and would make equal calls answer differently.
            return {"output": f"{args['path']}: {exc.strerror}", "ok": False}

    def execute_observed(self, call: Call) -> tuple[ToolResult, bool | None]:
        """The tools see names and contents only: a write of the content a file already has
        changes nothing. Anything else is left to the declarations (a new file, a failed write
        that may have made its folders)."""
        target = self._inside(call["args"].get("path", "")) if call["tool"] == "write_file" else None
        before = _read_bytes(target)
        result = self.execute(call)
        if before is not None and _read_bytes(target) == before:
            return result, False
        return result, None

    def fork(self) -> FolderEnvironment:
        assert self.path is not None
        twin = type(self)(self._seed_files, self._root)
        twin.path = twin._new_folder()
        shutil.copytree(self.path, twin.path, symlinks=True, dirs_exist_ok=True)
        return twin

    def stop(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None

    def mutates_state(self, call: Call) -> bool:
        return call["tool"] not in self.READ_ONLY

    def _new_folder(self) -> Path:
        return Path(tempfile.mkdtemp(prefix="tvclient-", dir=self._root))

    def _inside(self, path: str) -> Path | None:
        """The folder's file at `path`, or None when `path` would leave the folder."""
        assert self.path is not None
        relative = PurePosixPath(path)
        if relative.is_absolute() or ".." in relative.parts:
            return None
        return self.path / relative

    def _read_file(self, target: Path, path: str) -> ToolResult:
        return {"output": target.read_text(encoding="utf-8"), "ok": True}

    def _write_file(self, target: Path, path: str, content: str) -> ToolResult:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")
        return {"output": f"wrote {len(content)} characters to {path}", "ok": True}

    def _list_dir(self, target: Path, path: str) -> ToolResult:
        entries = sorted(f"{entry.name}/" if entry.is_dir() else entry.name for entry in target.iterdir())
        return {"output": "\n".join(entries), "ok": True}


def _read_bytes(target: Path | None) -> bytes | None:
    try:
        return target.read_bytes() if target is not None and target.is_file() else None
    except OSError:
        return None
