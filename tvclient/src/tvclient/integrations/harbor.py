"""Harbor: `BaseEnvironment` classes whose commands, uploads, file checks and downloads go
through tvcache.

One line in the job config (or `--env` on the command line; `--environment-import-path` is
its older spelling):

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
the sandbox is always in the state its history says before it runs anything.

Downloads and `is_dir`/`is_file` are reads of the sandbox's state, cached like any read. A
download is one call per source and filters (`exclude`, `include`, `protect`) and the mode the
target had before (a download may set it); where the trainer's files go is not part of it. It
runs into an empty staging folder, and its result records what it brought there, as a gzip tar
(base64): names, kinds (file, folder, link), modes and bytes. The trainer's target gets those,
on a miss as on a hit, written over what it holds (the contract Harbor's `download_dir` states:
it overwrites existing files). The host never follows a link of the sandbox's and trusts no
name in an archive: no absolute name, no `..`, no link that leads outside the target, no link
or other kind of file in the way of what it writes. A download it cannot serve that way (too
large for the service's result limit, TVCACHE_MAX_RESULT_BYTES; a special file or an outside
link in it; a target that holds a link or another kind where it writes) runs live in the
trial's sandbox after the catch-up (`download_live`, never served from the cache).

Results are the framework's own values: an exec's `ExecResult` fields, a check's bool. A value
that has no exact JSON form is left as it is, and the executor runs that call uncached.

Harbor environments cannot be forked: the tasks have a sandbox budget of 0 and a miss replays
in the trial's own sandbox. If a call raises (Harbor raises on a command's timeout), the
executor's known-state rule applies; the next miss then restarts the sandbox (stop, start) and
replays. Only the main service is cached: sidecar operations (`service_exec`, ...) pass through.
An environment that mounts host paths (auto mounting, `mounts`) is not cached: what a command
writes there lands on the host, and a hit would not write it.
"""

from __future__ import annotations

import base64
import contextvars
import gzip
import hashlib
import io
import json
import logging
import os
import shutil
import stat
import tarfile
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult

from ..client import TaskSpec, TVCacheClient
from ..executor import ToolCallExecutor
from ..results import Call, ToolResult
from . import _shared
from ._asyncio import AsyncRollout, LoopEnvironment

logger = logging.getLogger(__name__)

READS = frozenset({"is_dir", "is_file"})
# Reads of the sandbox into the trainer's files, served as archives: name -> its target argument.
DOWNLOADS = {
    "download_file": "target_path",
    "download_dir": "target_dir",
    "download_dir_with_exclusions": "target_dir",
    "download_dir_filtered": "target_dir",
}
LIVE = "download_live"  # a download the archive cannot carry: run in the sandbox, never served
RESULT_LIMIT_VARIABLE = "TVCACHE_MAX_RESULT_BYTES"  # the service's limit on a result's JSON
RESULT_LIMIT_DEFAULT = 1 << 20

# Set while the wrapper itself runs Harbor's own methods: the calls those make go straight through.
_direct: contextvars.ContextVar[bool] = contextvars.ContextVar("tvcache_harbor_direct", default=False)


class _Trial:
    """The rollout of one started environment: its executor and the copies of its uploads."""

    def __init__(self, environment: TVCacheEnvironment) -> None:
        self.environment = environment
        self.uploads = Path(tempfile.mkdtemp(prefix="tvcache-harbor-"))
        # The variables of its commands by their digest: the service keys calls by the digest and
        # never sees the values (an agent's API keys among them); replays take them from here.
        self.variables: dict[str, dict[str, str] | None] = {}
        self.restart = False  # the executor gave a sandbox up: the next one starts afresh
        self.calls = AsyncRollout(self._open_executor)

    def _open_executor(self, calls: AsyncRollout) -> ToolCallExecutor:
        environment: Any = self.environment  # a TVCacheEnvironment that is a BaseEnvironment
        spec = TaskSpec(
            env={
                "backend": "external",
                "harbor_environment": environment.environment_name,
                "definition": _definition(environment),
            },
            tools=_shared.declared_tools(READS | frozenset(DOWNLOADS), frozenset({LIVE})),
            sandbox_budget=0,
        )
        return ToolCallExecutor(
            environment.tvcache_client or _shared.shared_client(),
            environment.tvcache_task_id(),
            lambda: _Sandbox(self),
            rollout_id=f"{environment.session_id}-{uuid.uuid4().hex[:8]}",
            epoch=environment.tvcache_epoch,
            snapshots=_shared.snapshots,
            task=spec,
        )

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

    def mutates_state(self, call: Call) -> bool:
        return call["tool"] not in READS and call["tool"] not in DOWNLOADS and call["tool"] != LIVE

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
            args["env"] = self._trial.variables[args.pop("env_sha256")]
            done = await base.exec(**args)
            return {field: getattr(done, field) for field in type(done).model_fields}
        if name == "upload_file":
            await base.upload_file(self._trial.uploads / args["sha256"], args["target_path"])
        elif name == "upload_dir":
            await base.upload_dir(self._trial.uploads / args["sha256"], args["target_dir"])
        elif name in READS:
            return {"value": await getattr(base, name)(**args)}
        elif name in DOWNLOADS:
            return await _staged_download(base, name, args)
        elif name == LIVE:
            method = args.pop("method")
            await getattr(base, method)(**args)
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
            logger.warning("%s: tvcache is off for this environment: it mounts host paths", self.session_id)  # type: ignore[attr-defined]
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
        variables = merge(env) if merge else env
        kept = _shared.digest(variables)
        trial.variables[kept] = None if variables is None else dict(variables)
        args = {
            "command": command,
            "cwd": cwd,
            "env_sha256": kept,
            "timeout_sec": timeout_sec,
            "user": user if user is not None else getattr(self, "default_user", None),
        }
        result = await trial.calls.execute({"tool": "exec", "args": args})
        return ExecResult(**result)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        trial = self._tvcache_live()
        if trial is None:
            return await super().upload_file(source_path, target_path)  # type: ignore[misc]
        kept = trial.keep(Path(source_path))
        await trial.calls.execute({"tool": "upload_file", "args": {"sha256": kept, "target_path": target_path}})

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        trial = self._tvcache_live()
        if trial is None:
            return await super().upload_dir(source_dir, target_dir)  # type: ignore[misc]
        kept = trial.keep(Path(source_dir))
        await trial.calls.execute({"tool": "upload_dir", "args": {"sha256": kept, "target_dir": target_dir}})

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        await self._download("download_file", Path(target_path), source_path=source_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await self._download("download_dir", Path(target_dir), source_dir=source_dir)

    async def download_dir_with_exclusions(
        self, *, source_dir: str, target_dir: Path | str, exclude: list[str]
    ) -> None:
        await self._download(
            "download_dir_with_exclusions", Path(target_dir), source_dir=source_dir, exclude=list(exclude)
        )

    async def download_dir_filtered(
        self, *, source_dir: str, target_dir: Path | str, include: Any = None, exclude: Any = None, protect: Any = None
    ) -> None:
        await self._download(
            "download_dir_filtered",
            Path(target_dir),
            source_dir=source_dir,
            include=_listed(include),
            exclude=_listed(exclude),
            protect=_listed(protect),
        )

    async def is_dir(self, path: str, user: str | int | None = None) -> bool:
        return await self._check("is_dir", super().is_dir, path, user)  # type: ignore[misc]

    async def is_file(self, path: str, user: str | int | None = None) -> bool:
        return await self._check("is_file", super().is_file, path, user)  # type: ignore[misc]

    async def _check(self, name: str, direct: Any, path: str, user: str | int | None) -> Any:
        trial = self._tvcache_live()
        if trial is None:
            return await direct(path=path, user=user)
        # The effective user, as for exec: the check runs as that user.
        user = user if user is not None else getattr(self, "default_user", None)
        result = await trial.calls.execute({"tool": name, "args": {"path": path, "user": user}})
        return result["value"]

    async def _download(self, name: str, target: Path, **args: Any) -> None:
        """Serve a download from its archive (module docstring), else run it live."""
        trial = self._tvcache_live()
        if trial is None:
            return await getattr(super(), name)(**args, **{DOWNLOADS[name]: target})
        file = name == "download_file"
        try:
            before = _target_mode(target, file=file)
            result = await trial.calls.execute({"tool": name, "args": {**args, "target_mode": before}})
            if "archive" not in result:
                raise _Unservable(result.get("live", "the download has no archive"))
            _unpack(result["archive"], target, file=file)
        except _Unservable as exc:
            logger.info("%s of %s runs live: %s", name, args, exc)
            await trial.calls.execute({"tool": LIVE, "args": {"method": name, **args, DOWNLOADS[name]: str(target)}})

    def _tvcache_live(self) -> _Trial | None:
        """The trial, when calls should go through the cache: started, and not the wrapper's own."""
        return None if _direct.get() else self._tvcache_trial


def cached(environment_class: type[BaseEnvironment]) -> type[BaseEnvironment]:
    """`environment_class` with its calls going through tvcache."""
    return type(
        f"Cached{environment_class.__name__}",
        (TVCacheEnvironment, environment_class),
        {"__module__": __name__, "__qualname__": f"Cached{environment_class.__name__}"},
    )


def __getattr__(name: str) -> type[BaseEnvironment]:
    """`CachedDocker`, `CachedModal`, `CachedAppleContainer`...: the cached class of each of
    Harbor's environment types, for `import_path` (`tvclient.integrations.harbor:CachedDocker`)."""
    if not name.startswith("Cached"):
        raise AttributeError(name)
    from harbor.models.environment_type import EnvironmentType

    for member in EnvironmentType:
        if "".join(part.capitalize() for part in member.name.split("_")) == name[len("Cached") :]:
            environment_class = cached(_environment_class(member))
            globals()[name] = environment_class  # one class per name, as an import would give
            return environment_class
    raise AttributeError(f"{name}: no Harbor environment type {name[len('Cached') :]!r}")


def _environment_class(member: Any) -> type[BaseEnvironment]:
    """Harbor's class for an environment type: `EnvironmentFactory.get_environment_class` from
    0.26 on, the factory module's `_load_environment_class` in 0.25."""
    from harbor.environments import factory

    get = getattr(factory.EnvironmentFactory, "get_environment_class", None)
    return get(member) if get is not None else factory._load_environment_class(member)


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


# Downloads as archives -------------------------------------------------------------------------


class _Unservable(Exception):
    """A download that its archive cannot carry or the target cannot take: it runs live."""


@dataclass(frozen=True, slots=True)
class _Entry:
    """One entry of a download, named relative to its root ("." is the root itself)."""

    name: str
    kind: str  # "file", "dir" or "link"
    mode: int = 0
    data: bytes = b""
    link: str = ""


def _target_mode(target: Path, *, file: bool) -> int | None:
    """The permission bits of the target before the download (None: absent): a download may set
    them, so they are part of the call. A target of another kind than the download's, or a
    link, is not served."""
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        return None
    if not (stat.S_ISREG(info.st_mode) if file else stat.S_ISDIR(info.st_mode)):
        raise _Unservable(f"{target} is not a {'file' if file else 'folder'}")
    return stat.S_IMODE(info.st_mode)


async def _staged_download(base: Any, name: str, args: dict[str, Any]) -> ToolResult:
    """Run the download into an empty staging folder (its target given the recorded mode) and
    answer its archive, or why it has none."""
    file, before = name == "download_file", args.pop("target_mode")
    staging = Path(tempfile.mkdtemp(prefix="tvcache-harbor-download-"))
    try:
        target = staging / "target"
        if before is not None:
            target.touch() if file else target.mkdir()
            target.chmod(before)
        await getattr(base, name)(**args, **{DOWNLOADS[name]: target})
        limit = int(os.environ.get(RESULT_LIMIT_VARIABLE, RESULT_LIMIT_DEFAULT))
        try:
            entries = _entries(target, file=file, max_bytes=limit)
        except _Unservable as exc:
            return {"live": str(exc)}
        archive = base64.b64encode(_archive(entries)).decode("ascii")
        size = len(json.dumps({"archive": archive}))
        if size > limit:
            return {"live": f"its archive is {size} bytes, over the service's {limit}", "bytes": size}
        return {"archive": archive}
    finally:
        for folder, _, _ in os.walk(staging):  # a download may leave folders it cannot remove
            os.chmod(folder, 0o700)
        shutil.rmtree(staging, ignore_errors=True)


def _entries(root: Path, *, file: bool, max_bytes: int) -> list[_Entry]:
    """What the download wrote at `root`, parents before children, never following a link;
    _Unservable once its files hold more than `max_bytes` (never read into memory whole)."""
    entries: list[_Entry] = []
    total = 0

    def visit(path: Path, name: str) -> None:
        nonlocal total
        info = os.lstat(path)
        mode = stat.S_IMODE(info.st_mode)
        if stat.S_ISREG(info.st_mode):
            total += info.st_size
            if total > max_bytes:
                raise _Unservable(f"its files hold over {max_bytes} bytes, more than the service records")
            entries.append(_Entry(name, "file", mode, path.read_bytes()))
        elif stat.S_ISLNK(info.st_mode) and name != ".":
            entries.append(_Entry(name, "link", link=os.readlink(path)))
        elif stat.S_ISDIR(info.st_mode) and not file:
            entries.append(_Entry(name, "dir", mode))
            for child in sorted(os.listdir(path)):
                visit(path / child, child if name == "." else f"{name}/{child}")
        else:
            raise _Unservable(f"the download holds {name!r}, of a kind it does not carry")

    if os.path.lexists(root):
        visit(root, ".")
    _check_entries(entries, file=file)
    return entries


def _archive(entries: list[_Entry]) -> bytes:
    """The entries as a gzip tar with no times or owners: one state, one archive."""
    buffer = io.BytesIO()
    with tarfile.open(
        fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape"
    ) as tar:
        for entry in entries:
            info = tarfile.TarInfo(entry.name)
            info.mode, info.mtime, info.uid, info.gid = entry.mode, 0, 0, 0
            if entry.kind == "file":
                info.size = len(entry.data)
                tar.addfile(info, io.BytesIO(entry.data))
            else:
                info.type = tarfile.DIRTYPE if entry.kind == "dir" else tarfile.SYMTYPE
                info.linkname = entry.link
                tar.addfile(info)
    return gzip.compress(buffer.getvalue(), mtime=0)


def _read_archive(archive: str) -> list[_Entry]:
    try:
        raw = gzip.decompress(base64.b64decode(archive, validate=True))
        entries = []
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:", encoding="utf-8", errors="surrogateescape") as tar:
            for member in tar:
                if member.type in (tarfile.REGTYPE, tarfile.AREGTYPE):
                    extracted = tar.extractfile(member)
                    assert extracted is not None
                    entries.append(_Entry(member.name, "file", member.mode, extracted.read()))
                elif member.type == tarfile.DIRTYPE:
                    entries.append(_Entry(member.name, "dir", member.mode))
                elif member.type == tarfile.SYMTYPE:
                    entries.append(_Entry(member.name, "link", link=member.linkname))
                else:
                    raise _Unservable(f"the archive holds {member.name!r}, of a kind it does not carry")
    except (ValueError, OSError, EOFError, tarfile.TarError) as exc:
        raise _Unservable(f"the archive does not read: {exc}") from None
    return entries


def _check_entries(entries: list[_Entry], *, file: bool) -> None:
    """Names relative to the root, no `..`, each under a folder entry listed before it, at most
    once; a file download is one file at the root; links stay inside, through folders only."""
    folders: set[str] = set()
    seen: set[str] = set()
    for index, entry in enumerate(entries):
        if entry.name in seen:
            raise _Unservable(f"the archive repeats {entry.name!r}")
        if not 0 <= entry.mode <= 0o7777:
            raise _Unservable(f"the archive gives {entry.name!r} mode {entry.mode:o}")
        seen.add(entry.name)
        if entry.name == ".":
            if index != 0 or entry.kind != ("file" if file else "dir"):
                raise _Unservable("the archive's root is not first or not of the download's kind")
        else:
            parts = entry.name.split("/")
            if (
                file
                or "\0" in entry.name
                or any(part in ("", ".", "..") for part in parts)
                or _parent(entry.name) not in folders
            ):
                raise _Unservable(f"the archive holds a name it may not: {entry.name!r}")
        if entry.kind == "dir":
            folders.add(entry.name)
    for entry in entries:
        if entry.kind == "link" and not _link_inside(entry, folders):
            raise _Unservable(f"{entry.name!r} links to {entry.link!r}, outside the download")


def _parent(name: str) -> str:
    return name.rpartition("/")[0] or "."


def _link_inside(entry: _Entry, folders: set[str]) -> bool:
    """Whether the link resolves inside the root, walking only through the download's folders
    (a `..` after another link could lead anywhere)."""
    if not entry.link or entry.link.startswith("/") or "\0" in entry.link:
        return False
    parts = [part for part in entry.link.split("/") if part not in ("", ".")]
    at = [] if _parent(entry.name) == "." else _parent(entry.name).split("/")
    for index, part in enumerate(parts):
        if part == "..":
            if not at:
                return False
            at.pop()
        else:
            at.append(part)
            if index < len(parts) - 1 and "/".join(at) not in folders:
                return False
    return True


def _unpack(archive: str, target: Path, *, file: bool) -> None:
    """Write the download's entries over `target`, or raise _Unservable before writing anything
    if the archive or the target does not allow it."""
    entries = _read_archive(archive)
    _check_entries(entries, file=file)
    if entries and not os.path.lexists(target) and not target.parent.is_dir():
        raise _Unservable(f"{target.parent} is not a folder")
    for entry in entries:  # nothing in the way: no link, no other kind
        path = target if entry.name == "." else target.joinpath(*entry.name.split("/"))
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        fits = {"file": stat.S_ISREG, "dir": stat.S_ISDIR}.get(entry.kind)
        if fits is None or not fits(info.st_mode):
            raise _Unservable(f"{path} is in the way of the download's {entry.kind} {entry.name!r}")
    folders = []
    for entry in entries:
        path = target if entry.name == "." else target.joinpath(*entry.name.split("/"))
        if entry.kind == "dir":
            if not os.path.lexists(path):
                path.mkdir(mode=0o700)
            folders.append((path, entry.mode))
        elif entry.kind == "link":
            os.symlink(entry.link, path)
        else:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(descriptor, "wb") as written:
                written.write(entry.data)
                os.fchmod(written.fileno(), entry.mode)
    for path, mode in reversed(folders):  # children first: a folder's mode may forbid writing
        path.chmod(mode)
