"""A stand-in for Harbor (harbor >= 0.26 needs Python 3.12; this machine runs 3.11).

`BaseEnvironment` keeps the constructor, the abstract methods and the helpers the wrapper
relies on, with Harbor's signatures: `exec(command, cwd, env, timeout_sec, user)` (a timeout
raises RuntimeError, as Harbor's docker environment does), `upload_file`, `upload_dir` (the
source's contents go into the target), `download_file`, `download_dir`, `start(force_build)`,
`stop(delete)`, `is_dir`/`is_file` through `exec`, `default_user`, `_merge_env` and
`environment_id`. `LocalEnvironment` runs the commands for real, in a folder of its own (its
start() runs one itself, as Harbor's does), and stands in for the "docker" type of
`EnvironmentFactory`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import types
from abc import ABC, abstractmethod
from enum import Enum
from functools import cached_property
from pathlib import Path

from pydantic import BaseModel


class ExecResult(BaseModel):
    stdout: str | None = None
    stderr: str | None = None
    return_code: int


class BaseEnvironment(ABC):
    def __init__(self, environment_dir: Path, environment_name: str, session_id: str, trial_paths,
                 task_env_config, logger: logging.Logger | None = None,
                 persistent_env: dict[str, str] | None = None, **kwargs) -> None:
        self.environment_dir = environment_dir
        self.environment_name = environment_name
        self.session_id = session_id
        self.trial_paths = trial_paths
        self.task_env_config = task_env_config
        self.logger = logger or logging.getLogger(__name__)
        self.default_user: str | int | None = None
        self._persistent_env = persistent_env or {}
        self._host_mounts: list = []

    @cached_property
    def environment_id(self) -> str:
        digest = hashlib.sha256()
        for path in sorted(Path(self.environment_dir).rglob("*")):
            if path.is_file():
                digest.update(path.relative_to(self.environment_dir).as_posix().encode())
                digest.update(path.read_bytes())
        return digest.hexdigest()

    def _merge_env(self, env: dict[str, str] | None) -> dict[str, str] | None:
        merged = {**self._persistent_env, **(env or {})}
        return merged or None

    @staticmethod
    @abstractmethod
    def type() -> str: ...

    @abstractmethod
    async def start(self, force_build: bool) -> None: ...

    @abstractmethod
    async def stop(self, delete: bool): ...

    @abstractmethod
    async def upload_file(self, source_path: Path | str, target_path: str): ...

    @abstractmethod
    async def upload_dir(self, source_dir: Path | str, target_dir: str): ...

    @abstractmethod
    async def download_file(self, source_path: str, target_path: Path | str): ...

    @abstractmethod
    async def download_dir(self, source_dir: str, target_dir: Path | str): ...

    @abstractmethod
    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult: ...

    async def is_dir(self, path: str, user: str | int | None = None) -> bool:
        return (await self.exec(f"test -d {path}", timeout_sec=10, user=user)).return_code == 0

    async def is_file(self, path: str, user: str | int | None = None) -> bool:
        return (await self.exec(f"test -f {path}", timeout_sec=10, user=user)).return_code == 0


class LocalEnvironment(BaseEnvironment):
    """Runs each command with `sh -c` in a folder of its own (paths are relative to it).

    `commands` lists every command any instance ran, to tell hits from executions.
    """

    commands: list[str] = []
    starts = 0

    @staticmethod
    def type() -> str:
        return "docker"

    async def start(self, force_build: bool) -> None:
        type(self).starts += 1
        self.root = Path(tempfile.mkdtemp(prefix="harbor-standin-"))
        await self.exec("mkdir -p logs")  # as Harbor's start() runs commands of its own

    async def stop(self, delete: bool) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _inside(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    async def upload_file(self, source_path, target_path: str) -> None:
        self._inside(target_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source_path, self._inside(target_path))

    async def upload_dir(self, source_dir, target_dir: str) -> None:
        shutil.copytree(source_dir, self._inside(target_dir), dirs_exist_ok=True)

    async def download_file(self, source_path: str, target_path) -> None:
        shutil.copy2(self._inside(source_path), target_path)

    async def download_dir(self, source_dir: str, target_dir) -> None:
        shutil.copytree(self._inside(source_dir), target_dir, dirs_exist_ok=True)

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        type(self).commands.append(command)
        process = await asyncio.create_subprocess_shell(
            command, cwd=self._inside(cwd) if cwd else self.root,
            env={"PATH": os.environ["PATH"], **(self._merge_env(env) or {})},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=timeout_sec)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(stdout=stdout.decode(), stderr=stderr.decode(), return_code=process.returncode)


class EnvironmentType(str, Enum):
    DOCKER = "docker"


class EnvironmentFactory:
    @classmethod
    def get_environment_class(cls, environment_type: EnvironmentType | None = None,
                              import_path: str | None = None) -> type[BaseEnvironment]:
        if environment_type is EnvironmentType.DOCKER:
            return LocalEnvironment
        raise ValueError(f"Unsupported environment type: {environment_type}")


def install() -> None:
    """Put the stand-in where `import harbor...` finds it."""
    modules = {name: types.ModuleType(name) for name in (
        "harbor", "harbor.environments", "harbor.environments.base", "harbor.environments.factory",
        "harbor.models", "harbor.models.environment_type")}
    for name in ("harbor", "harbor.environments", "harbor.models"):
        modules[name].__path__ = []
    base, factory = modules["harbor.environments.base"], modules["harbor.environments.factory"]
    base.ExecResult, base.BaseEnvironment = ExecResult, BaseEnvironment
    factory.EnvironmentFactory = EnvironmentFactory
    modules["harbor.models.environment_type"].EnvironmentType = EnvironmentType
    sys.modules.update(modules)
