"""Harbor: `BaseEnvironment` classes whose commands and uploads go through tvcache.

One line in the job config (or `--environment-import-path` on the command line):

    environment:
      import_path: tvclient.integrations.harbor:CachedDocker   # any type: CachedModal, CachedDaytona, ...

or in code: `cached(DockerEnvironment)`. The environment starts as before; after that, each
`exec(command, cwd, env, timeout_sec, user)` is a call whose arguments are the effective ones
(the default user, the merged environment variables), and each upload is a call named by its
content's digest, so trials of a task hit each other's results. A trial is a rollout; `stop()`
ends it. The task is the environment's name qualified by its definition's content hash
(`environment_id`): Harbor gives a task's separate verifier environment the same name.

A hit runs nothing in the sandbox. The next call that misses first replays, in order, the
state-changing calls the sandbox has not run (the uploads from copies the wrapper kept), so
the sandbox is always in the state its history says before it runs anything. Downloads and
`is_dir`/`is_file` read the sandbox: downloads always run there (after that catch-up) and are
never served from the cache, since they write the trainer's own files.

Harbor environments cannot be forked: the tasks have a sandbox budget of 0 and a miss replays
in the trial's own sandbox. If a call raises (Harbor raises on a command's timeout), the
executor's known-state rule applies; the next miss then restarts the sandbox (stop, start) and
replays. Only the main service is cached: sidecar operations (`service_exec`, ...) pass through.
An environment that mounts host paths (auto mounting, `mounts`) is not cached: what a command
writes there lands on the host, and a hit would not write it.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import os
import shutil
import stat
import tempfile
import uuid
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult

from ..client import TVCacheClient
from ..executor import ToolCallExecutor
from ..results import Call, ToolResult
from . import _shared
from ._asyncio import AsyncRollout, LoopEnvironment

logger = logging.getLogger(__name__)

# Reads of the sandbox into the trainer's files: run at the rollout's current state, never served.
DOWNLOADS = frozenset({"download_file", "download_dir", "download_dir_with_exclusions",
                       "download_dir_filtered"})
READS = frozenset({"is_dir", "is_file"})

# Set while the wrapper itself runs Harbor's own methods: the calls those make go straight through.
_direct: contextvars.ContextVar[bool] = contextvars.ContextVar("tvcache_harbor_direct", default=False)


class _Trial:
    """The rollout of one started environment: its executor and the copies of its uploads."""

    def __init__(self, environment: TVCacheEnvironment) -> None:
        self.environment = environment
        self.uploads = Path(tempfile.mkdtemp(prefix="tvcache-harbor-"))
        self.restart = False  # the executor gave a sandbox up: the next one starts afresh
        self.calls = AsyncRollout(self._open_executor)

    def _open_executor(self, calls: AsyncRollout) -> ToolCallExecutor:
        environment = self.environment
        client = environment.tvcache_client or _shared.shared_client()
        task_id = environment.tvcache_task_id()
        _shared.ensure_task(
            client,
            task_id,
            env={"backend": "external", "harbor_environment": environment.environment_name,
                 "definition": _definition(environment)},
            tools=_shared.declared_tools(READS, DOWNLOADS),
            sandbox_budget=0,
        )
        return ToolCallExecutor(client, task_id, lambda: _Sandbox(self),
                                rollout_id=f"{environment.session_id}-{uuid.uuid4().hex[:8]}",
                                epoch=environment.tvcache_epoch, snapshots=_shared.snapshots)

    def keep(self, source: Path) -> str:
        """Copy an upload's source (file or tree) under its content digest, for replays."""
        name = _content_digest(source)
        kept = self.uploads / name
        if not kept.exists():
            if source.is_dir():
                shutil.copytree(source, kept, symlinks=True)
            else:
                shutil.copy2(source, kept)
        return name

    async def end(self) -> None:
        try:
            await self.calls.end()
        finally:
            shutil.rmtree(self.uploads, ignore_errors=True)


class _Sandbox(LoopEnvironment):
    """The trial's own Harbor sandbox, driven by Harbor's own methods."""

    def __init__(self, trial: _Trial) -> None:
        assert trial.calls.loop is not None  # set by the call that opens the executor
        super().__init__(trial.calls.loop)
        self._trial = trial

    async def astart(self) -> None:
        _direct.set(True)  # this coroutine runs in a context of its own
        if self._trial.restart:
            base = super(TVCacheEnvironment, self._trial.environment)
            await base.stop(delete=True)
            await base.start(force_build=False)
        self._trial.restart = False

    async def aexecute(self, call: Call) -> ToolResult:
        _direct.set(True)
        base = super(TVCacheEnvironment, self._trial.environment)
        name, args = call["tool"], dict(call["args"])
        if name == "exec":
            done = await base.exec(**args)
            return {"stdout": done.stdout, "stderr": done.stderr, "return_code": done.return_code}
        if name == "upload_file":
            await base.upload_file(self._trial.uploads / args["sha256"], args["target_path"])
        elif name == "upload_dir":
            await base.upload_dir(self._trial.uploads / args["sha256"], args["target_dir"])
        elif name in READS:
            return {"value": await getattr(base, name)(**args)}
        else:
            await getattr(base, name)(**args)
        return {}

    async def astop(self) -> None:
        self._trial.restart = True


class TVCacheEnvironment:
    """Put before a Harbor `BaseEnvironment` subclass (see `cached`) to cache its calls.

    Set `tvcache_client` (else TVCACHE_URL and TVCACHE_TOKEN name the service) and
    `tvcache_epoch` on a subclass to change them.
    """

    tvcache_client: TVCacheClient | None = None
    tvcache_epoch: int | None = None
    _tvcache_trial: _Trial | None = None

    def tvcache_task_id(self) -> str:
        return _shared.task_slug(f"{self.environment_name}-{_definition(self)[:12]}")  # type: ignore[attr-defined]

    async def start(self, force_build: bool) -> None:
        token = _direct.set(True)  # what start() runs itself is part of the fresh sandbox
        try:
            await super().start(force_build)  # type: ignore[misc]
        finally:
            _direct.reset(token)
        if getattr(self, "_host_mounts", None):
            # What a command writes under a host mount lands in the trainer's files, which a
            # hit would not reproduce.
            logger.warning("%s: tvcache is off for this environment: it mounts host paths",
                           self.session_id)  # type: ignore[attr-defined]
            return
        self._tvcache_trial = _Trial(self)

    async def stop(self, delete: bool) -> Any:
        """End the rollout (its last record is sent), then stop the sandbox as Harbor would."""
        trial, self._tvcache_trial = self._tvcache_trial, None
        if trial is not None:
            await trial.end()
        return await super().stop(delete)  # type: ignore[misc]

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        trial = self._tvcache_live()
        if trial is None:
            return await super().exec(command, cwd=cwd, env=env, timeout_sec=timeout_sec, user=user)  # type: ignore[misc]
        # The effective user and variables: those are what the command runs with.
        merge = getattr(self, "_merge_env", None)
        args = {"command": command, "cwd": cwd, "env": merge(env) if merge else env,
                "timeout_sec": timeout_sec,
                "user": user if user is not None else getattr(self, "default_user", None)}
        result = await trial.calls.execute({"tool": "exec", "args": args})
        return ExecResult(stdout=result["stdout"], stderr=result["stderr"],
                          return_code=result["return_code"])

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        trial = self._tvcache_live()
        if trial is None:
            return await super().upload_file(source_path, target_path)  # type: ignore[misc]
        kept = trial.keep(Path(source_path))
        await trial.calls.execute({"tool": "upload_file",
                                   "args": {"sha256": kept, "target_path": target_path}})

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        trial = self._tvcache_live()
        if trial is None:
            return await super().upload_dir(source_dir, target_dir)  # type: ignore[misc]
        kept = trial.keep(Path(source_dir))
        await trial.calls.execute({"tool": "upload_dir",
                                   "args": {"sha256": kept, "target_dir": target_dir}})

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        await self._read("download_file", super().download_file, source_path=source_path,  # type: ignore[misc]
                         target_path=str(target_path))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await self._read("download_dir", super().download_dir, source_dir=source_dir,  # type: ignore[misc]
                         target_dir=str(target_dir))

    async def download_dir_with_exclusions(
        self, *, source_dir: str, target_dir: Path | str, exclude: list[str]
    ) -> None:
        await self._read("download_dir_with_exclusions", super().download_dir_with_exclusions,  # type: ignore[misc]
                         source_dir=source_dir, target_dir=str(target_dir), exclude=list(exclude))

    async def download_dir_filtered(self, *, source_dir: str, target_dir: Path | str,
                                    include: Any = None, exclude: Any = None, protect: Any = None) -> None:
        await self._read("download_dir_filtered", super().download_dir_filtered,  # type: ignore[misc]
                         source_dir=source_dir, target_dir=str(target_dir),
                         include=_listed(include), exclude=_listed(exclude), protect=_listed(protect))

    async def is_dir(self, path: str, user: str | int | None = None) -> bool:
        return await self._read("is_dir", super().is_dir, path=path, user=user)  # type: ignore[misc]

    async def is_file(self, path: str, user: str | int | None = None) -> bool:
        return await self._read("is_file", super().is_file, path=path, user=user)  # type: ignore[misc]

    async def _read(self, name: str, direct: Any, **args: Any) -> Any:
        trial = self._tvcache_live()
        if trial is None:
            return await direct(**args)
        result = await trial.calls.execute({"tool": name, "args": args})
        return result.get("value")

    def _tvcache_live(self) -> _Trial | None:
        """The trial, when calls should go through the cache: started, and not the wrapper's own."""
        return None if _direct.get() else self._tvcache_trial


def cached(environment_class: type[BaseEnvironment]) -> type[BaseEnvironment]:
    """`environment_class` with its calls going through tvcache."""
    return type(f"Cached{environment_class.__name__}", (TVCacheEnvironment, environment_class),
                {"__module__": __name__, "__qualname__": f"Cached{environment_class.__name__}"})


def __getattr__(name: str) -> type[BaseEnvironment]:
    """`CachedDocker`, `CachedModal`, `CachedAppleContainer`...: the cached class of each of
    Harbor's environment types, for `import_path` (`tvclient.integrations.harbor:CachedDocker`)."""
    if not name.startswith("Cached"):
        raise AttributeError(name)
    from harbor.environments.factory import EnvironmentFactory
    from harbor.models.environment_type import EnvironmentType

    for member in EnvironmentType:
        if "".join(part.capitalize() for part in member.name.split("_")) == name[len("Cached"):]:
            environment_class = cached(EnvironmentFactory.get_environment_class(member))
            globals()[name] = environment_class  # one class per name, as an import would give
            return environment_class
    raise AttributeError(f"{name}: no Harbor environment type {name[len('Cached'):]!r}")


def _definition(environment: Any) -> str:
    """The environment definition's content hash: Harbor's own `environment_id` where it has one."""
    identity = getattr(environment, "environment_id", None)
    return identity if identity else _content_digest(Path(environment.environment_dir))


def _content_digest(source: Path) -> str:
    """sha256 over a file's bytes and mode, or over a tree's relative paths, kinds, modes,
    contents and link targets: what an upload puts into the sandbox, not where it came from."""
    digest = hashlib.sha256()
    entries = [source] if not source.is_dir() else sorted(source.rglob("*"))
    for entry in entries:
        relative = "." if entry == source else entry.relative_to(source).as_posix()
        info = entry.lstat()
        digest.update(f"{relative}\0{stat.S_IFMT(info.st_mode)}\0{stat.S_IMODE(info.st_mode)}\0".encode())
        if entry.is_symlink():
            digest.update(os.readlink(entry).encode())
        elif entry.is_file():
            digest.update(hashlib.sha256(entry.read_bytes()).digest())
        digest.update(b"\n")
    return digest.hexdigest()


def _listed(patterns: Any) -> list[str] | None:
    return None if patterns is None else list(patterns)
