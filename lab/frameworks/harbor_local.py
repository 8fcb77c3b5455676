"""A Harbor environment whose sandbox is a folder on this machine (no Docker needed).

`LocalFolderEnvironment` is a real `harbor.environments.base.BaseEnvironment`: Harbor's trial,
agents and verifier drive it as they drive Docker. Each sandbox is a temporary folder (its
"box") that holds the sandbox's own top-level folders (`/app`, the workdir, `/logs`, `/tests`,
`/solution`, `/tmp`, `/root`, `/home`). A command runs with `bash -c` in a mount namespace of its
own (`unshare -m`), chrooted into the box, with the host's `/usr` and `/etc` bound read-only and
`/dev` and `/proc` bound in, so that Harbor's absolute paths (`/logs/verifier/reward.txt`) are
the box's and nothing else of the host is visible. A new top-level folder lives in the box too.
Uploads and downloads copy between the host and the box (links are copied as links, never
followed). Commands run as the calling user whatever `user` says, with only the variables
Harbor passes (plus PATH and HOME).

Lab instrumentation, outside the sandbox's state (so not part of any cache key):
`--ek probe_dir=/host/folder` binds that host folder at `/probe` in every command (the task's
solve.sh appends a line there each time it runs), and each operation that really ran in a
sandbox is appended to `/host/folder/operations.jsonl` (session, operation, command or paths).

    harbor run -p TASK -a oracle --env harbor_local:CachedLocalFolder --ek probe_dir=/tmp/probe
    harbor run -p TASK -a oracle --env harbor_local:LocalFolderEnvironment   # uncached

Needs root or an unprivileged user namespace for `unshare -m` and `mount --bind`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult

from tvclient.integrations.harbor import cached

OWN = ("app", "home", "logs", "root", "solution", "tests", "tmp")  # the box's own folders
HOST_READ_ONLY = ("usr", "etc")
HOST_BOUND = ("dev", "proc")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Run in a fresh mount namespace: bind the host folders into the box, the probe at /probe,
# chroot, cd, and run the command with only the variables given.
_ENTER = r"""
set -e
box=$1; probe=$2; cwd=$3; shift 3
for d in usr etc; do mount --rbind "/$d" "$box/$d"; mount -o remount,bind,ro "$box/$d"; done
for d in dev proc; do mount --rbind "/$d" "$box/$d"; done
if [ -n "$probe" ]; then mkdir -p "$box/probe"; mount --bind "$probe" "$box/probe"; fi
exec chroot "$box" /bin/bash -c 'cd -- "$1" || exit 1; shift; exec /usr/bin/env -i "$@"' enter "$cwd" "$@"
"""


class LocalFolderEnvironment(BaseEnvironment):
    """A sandbox in a folder, entered through a mount namespace (module docstring)."""

    def __init__(self, *args: Any, probe_dir: str | None = None, **kwargs: Any) -> None:
        self._probe = Path(probe_dir).resolve() if probe_dir else None
        self._box: Path | None = None
        self._starting = False
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return "local-folder"

    def _validate_definition(self) -> None:
        if not Path(self.environment_dir).is_dir():
            raise FileNotFoundError(f"{self.environment_dir} is not a folder")

    @property
    def workdir(self) -> str:
        return self.task_env_config.workdir or "/app"

    async def start(self, force_build: bool) -> None:
        box = Path(tempfile.mkdtemp(prefix="harbor-box-"))
        for name in OWN:
            (box / name).mkdir()
        (box / "tmp").chmod(0o1777)
        for name in HOST_READ_ONLY + HOST_BOUND:
            (box / name).mkdir()
        for entry in Path("/").iterdir():  # /bin -> usr/bin and the like
            if entry.is_symlink() and entry.name not in OWN:
                (box / entry.name).symlink_to(os.readlink(entry))
        self._box = box
        self._log("start", box=str(box))
        # Harbor's output folders (/logs/agent, ...), as its remote providers make them.
        self._starting = True
        try:
            await self.ensure_dirs(self._mount_targets(writable_only=True))
        finally:
            self._starting = False

    async def stop(self, delete: bool) -> None:
        box, self._box = self._box, None
        if box is not None and delete:
            shutil.rmtree(box, ignore_errors=True)

    def _path(self, sandbox_path: str | PurePosixPath) -> Path:
        """The host path of a sandbox path (relative ones are under the workdir)."""
        assert self._box is not None, "the sandbox is not started"
        path = PurePosixPath(self.workdir) / PurePosixPath(sandbox_path)
        parts = [part for part in path.parts[1:] if part not in ("", ".")]
        if ".." in parts:
            raise ValueError(f"{sandbox_path!r}: no '..' in sandbox paths")
        return self._box.joinpath(*parts)

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        assert self._box is not None, "the sandbox is not started"
        variables = {"PATH": PATH, "HOME": "/root", **(self._merge_env(env) or {})}
        self._log("exec", command=command)
        process = await asyncio.create_subprocess_exec(
            "unshare",
            "-m",
            "bash",
            "-c",
            _ENTER,
            "enter",
            str(self._box),
            str(self._probe or ""),
            cwd or self.workdir,
            *(f"{key}={value}" for key, value in variables.items()),
            "/bin/bash",
            "-c",
            command,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={"PATH": PATH},
            start_new_session=True,
        )
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=timeout_sec)
        except TimeoutError:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds") from None
        return ExecResult(
            stdout=stdout.decode(errors="replace"),
            stderr=stderr.decode(errors="replace"),
            return_code=process.returncode,
        )

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        target = self._path(target_path)
        self._log("upload_file", target=target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source_path, target)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        self._log("upload_dir", target=target_dir)
        _copy_tree(Path(source_dir), self._path(target_dir))

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        source = self._path(source_path)
        self._log("download_file", source=source_path)
        if source.is_symlink() or not source.is_file():
            raise FileNotFoundError(f"{source_path} is not a regular file in the sandbox")
        shutil.copy(source, target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        source = self._path(source_dir)
        self._log("download_dir", source=source_dir)
        if source.is_symlink() or not source.is_dir():
            raise FileNotFoundError(f"{source_dir} is not a folder in the sandbox")
        _copy_tree(source, Path(target_dir))

    def _log(self, operation: str, **details: str) -> None:
        if self._probe is not None:
            phase = {"phase": "start"} if self._starting or operation == "start" else {}
            line = json.dumps({"session": self.session_id, "operation": operation, **phase, **details})
            with open(self._probe / "operations.jsonl", "a") as log:
                log.write(line + "\n")


def _copy_tree(source: Path, target: Path) -> None:
    """Copy `source`'s content into `target` (made if missing) as `tar x` would: files and links
    replace what is there (a link is replaced, never written through), links stay links, and
    folders take their source's mode."""
    target.mkdir(parents=True, exist_ok=True)
    shutil.copymode(source, target)
    for entry in sorted(source.iterdir()):
        destination = target / entry.name
        replaced = destination.is_symlink() or (destination.exists() and not destination.is_dir())
        if replaced and (entry.is_symlink() or not entry.is_dir() or destination.is_symlink()):
            destination.unlink()
        if entry.is_symlink():
            os.symlink(os.readlink(entry), destination)
        elif entry.is_dir():
            _copy_tree(entry, destination)
        elif destination.is_dir():
            raise IsADirectoryError(f"{destination} is a folder; {entry} is a file")
        else:
            shutil.copy(entry, destination)


CachedLocalFolder = cached(LocalFolderEnvironment)
