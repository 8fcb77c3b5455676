"""Sandboxes whose snapshots keep their processes: the OCI runtime a sandbox runs under, and
checkpoints of its processes and memory where the runtime can take them (docs/operations/runtimes.md).

A task picks its runtime with `"runtime"` in its env (the operator's default, `DockerConfig.runtime`,
when it names none) among those the operator allows; `"keep_processes": true` asks for one whose
snapshots keep processes, and is refused (`processes_not_kept`) where there is none. gVisor's runsc
checkpoints by itself; runc only where CRIU works on the engine's kernel, so it is not a checkpoint
runtime unless the operator says so.

A snapshot of a checkpointing sandbox is a checkpoint plus a commit, under one ref:
- the checkpoint stops the container (`docker checkpoint create`: the runtime writes the
  processes' state into the container's folder), the commit then takes its files in exactly the
  state the processes saw, and the container is restored from its own checkpoint: the sandbox goes
  on as a fork of it would;
- the checkpoint is kept in a folder of the service's beside the engine's data root
  (`<data root>-checkpoints/<tag>`, the tag being the snapshot image's), since the container it
  came from goes with its rollout;
- a fork is a container created from the image, the checkpoint placed in its folder, then
  started from it (`docker start --checkpoint`; Docker refuses a checkpoint folder of the caller's
  choice at start). Its processes go on where they were, with their memory.

Both copies are made from the host without trusting what they hold: the runtime wrote them, but
from the sandbox's memory, so nothing in them is followed (hostfs: no links, FIFOs or devices, a
cap on the bytes). The copy into the container's folder is removed once the container runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import docker
import docker.errors

from .. import hostfs
from ..base import InvalidEnv, NotGranted, SandboxError
from ..config import DockerConfig
from ..procs import INSIDE_SCAN, InsideProcess, inside_listing, with_descendants
from .agent import AGENT_NAME
from .engine import EngineFacts

_START_ATTEMPTS = 4  # a restore whose checkpoint upload met content already there (checkpoint_start)
_START_RETRY_S = 0.25
_RUNTIME_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# A checkpoint holds the sandbox's memory: never more than this is copied (a sandbox's memory
# limit is at most DockerConfig.max_memory_mb, and the runtime's own state comes on top).
_COPY_SLACK_BYTES = 256 << 20
_DIR_MODE = 0o700
# Host tasks of a gVisor sandbox (measured: bench_runtimes, docs/operations/runtimes.md).
_RUNSC_TASKS_PER_PROCESS = 16
_RUNSC_OWN_TASKS = 256


class RuntimeNotGranted(NotGranted):
    code = "runtime_not_granted"


class RuntimeUnavailable(InvalidEnv):
    """The engine does not run the runtime, or runs it without something the task asks for."""

    code = "runtime_unavailable"


class ProcessesNotKept(InvalidEnv):
    """The env asks for processes that survive snapshots, and no runtime here can keep them."""

    code = "processes_not_kept"


class CheckpointFailed(SandboxError):
    code = "checkpoint_failed"


@dataclass(frozen=True)
class SandboxRuntime:
    """The runtime a task's sandboxes run under, and whether their snapshots are checkpoints."""

    name: str
    checkpoints: bool

    @classmethod
    def parse(cls, env: Mapping[str, Any], config: DockerConfig, facts: EngineFacts | None = None) -> SandboxRuntime:
        """The task's runtime within the operator's grant; with `facts`, also on that engine.
        Refusals: RuntimeNotGranted (403), RuntimeUnavailable and ProcessesNotKept (400)."""
        named, keep = env.get("runtime"), env.get("keep_processes", False)
        if named is not None and not (isinstance(named, str) and _RUNTIME_NAME.fullmatch(named)):
            raise InvalidEnv('"runtime" must be the name of a runtime, such as "runc" or "runsc"')
        if not isinstance(keep, bool):
            raise InvalidEnv('"keep_processes" must be a boolean')
        granted = (config.runtime, *config.runtimes)
        if named is not None and named not in granted:
            raise RuntimeNotGranted(
                f"runtime {named!r} is not one this service runs (TVCACHE_DOCKER_RUNTIMES)",
                details={"allowed": sorted(set(granted))},
            )

        def keeps(name: str) -> bool:
            return name in config.checkpoint_runtimes and (facts is None or facts.checkpoints)

        name = named or config.runtime
        if keep and not keeps(name):
            found = None if named is not None else next((r for r in granted if keeps(r)), None)
            if found is None:
                raise ProcessesNotKept(
                    _not_kept(named, config, facts),
                    details={
                        "runtime": named,
                        "checkpoint_runtimes": sorted(set(granted) & set(config.checkpoint_runtimes)),
                    },
                )
            name = found
        return cls(name=name, checkpoints=keeps(name))

    def check_engine(self, facts: EngineFacts, *, network: bool) -> None:
        """Refuses a runtime the engine lacks, or one it runs without a network the task asks for."""
        args = facts.runtimes.get(self.name)
        if args is None:
            raise RuntimeUnavailable(
                f"the docker engine has no runtime {self.name!r} (docs/operations/runtimes.md)",
                details={"runtime": self.name, "engine_runtimes": sorted(facts.runtimes)},
            )
        if network and "--network=none" in args:
            raise RuntimeUnavailable(
                f"the engine runs {self.name!r} without a network, and the task asks for one",
                details={"runtime": self.name},
            )

    def engine_pids(self, pids: int) -> int:
        """The engine's pids limit for a sandbox allowed `pids` processes. The limit counts host
        tasks; gVisor's (ptrace platform) are about ten per sandbox process plus some sixty of its
        own, and it dies when it cannot make one, so its limit leaves room for `pids` processes
        (docs/operations/runtimes.md)."""
        return pids if self.host_sees_processes else pids * _RUNSC_TASKS_PER_PROCESS + _RUNSC_OWN_TASKS

    @property
    def host_sees_processes(self) -> bool:
        """False for gVisor: its sandboxes' processes live in a kernel of its own, and the host sees
        only the runtime's (kill_calls_inside)."""
        return self.name != "runsc"

    def fingerprint(self) -> dict[str, Any]:
        """Tool results can depend on the runtime (gVisor has its own kernel: `uname`, /proc), so
        it is part of the env fingerprint; runc, which every task ran under before, is left out."""
        return {} if self.name == "runc" else {"runtime": self.name}


def _not_kept(named: str | None, config: DockerConfig, facts: EngineFacts | None) -> str:
    if named is not None and named not in config.checkpoint_runtimes:
        return f"runtime {named!r} cannot keep processes across snapshots here; runsc (gVisor) can"
    if facts is not None and not facts.checkpoints:
        return "the docker engine was started without its checkpoint API (experimental): processes cannot be kept"
    return "no runtime this service runs keeps processes across snapshots (TVCACHE_DOCKER_CHECKPOINT_RUNTIMES)"


class CheckpointStore:
    """The service's checkpoints on one engine's host, one folder per snapshot tag, beside the
    engine's data root; and the containers' checkpoint folders they are placed into for a restore.
    Only usable where the engine's data root is in this host's reach (a local engine)."""

    def __init__(self, facts: EngineFacts, *, max_bytes: int):
        self.data_root = facts.data_root
        self.root = facts.data_root.rstrip("/") + "-checkpoints" if facts.data_root else ""
        self.max_bytes = max_bytes

    @classmethod
    def for_config(cls, facts: EngineFacts, config: DockerConfig) -> CheckpointStore:
        return cls(facts, max_bytes=(config.max_memory_mb << 20) + _COPY_SLACK_BYTES)

    def reachable(self, container_id: str) -> bool:
        return bool(self.data_root) and os.path.isdir(self._container_dir(container_id))

    def keep(self, container_id: str, name: str) -> int:
        """Copies the container's checkpoint `name` into the store; returns its bytes."""
        os.makedirs(self.root, mode=_DIR_MODE, exist_ok=True)
        target = os.path.join(self.root, name)
        try:
            return _copy_tree(
                os.path.join(self._container_dir(container_id), "checkpoints", name), target, self.max_bytes
            )
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise

    def place(self, name: str, container_id: str) -> None:
        """Copies the stored checkpoint `name` into the (created, not started) container's folder."""
        source = os.path.join(self.root, name)
        if not os.path.isdir(source):
            raise FileNotFoundError(f"checkpoint {name} is not in {self.root}")
        folder = os.path.join(self._container_dir(container_id), "checkpoints")
        os.makedirs(folder, mode=_DIR_MODE, exist_ok=True)
        _copy_tree(source, os.path.join(folder, name), self.max_bytes)

    def size(self, name: str) -> int:
        return sum(st.st_size for _, st in hostfs.walk(os.path.join(self.root, name)) if stat.S_ISREG(st.st_mode))

    def drop(self, name: str) -> None:
        if self.root:
            shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def _container_dir(self, container_id: str) -> str:
        if not re.fullmatch(r"[0-9a-f]{64}", container_id):
            raise ValueError(f"not a full container id: {container_id!r}")
        return os.path.join(self.data_root, "containers", container_id)


def _copy_tree(source: str, target: str, max_bytes: int) -> int:
    """A copy of folder `source` (regular files and folders only: anything else is refused, and no
    link is followed) as a new folder `target`; at most `max_bytes` in all."""
    os.mkdir(target, _DIR_MODE)
    copied = 0
    for relative, st in hostfs.walk(source, max_entries=10_000):
        path = os.path.join(target, relative)
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(path, _DIR_MODE)
        elif stat.S_ISREG(st.st_mode):
            copied += _copy_file(source, relative, path, max_bytes - copied)
        else:
            raise hostfs.UnsafeEntry(f"{relative}: not a regular file or folder in a checkpoint")
    return copied


def _copy_file(root: str, relative: str, target: str, max_bytes: int) -> int:
    parent, _, name = relative.rpartition("/")
    with hostfs.open_dir(root, parent) as dir_fd:
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        size = os.fstat(src).st_size
        if not stat.S_ISREG(os.fstat(src).st_mode) or size > max_bytes:
            raise hostfs.UnsafeEntry(f"{relative}: not a regular file, or larger than a checkpoint may be")
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            copied = 0
            while copied < size:
                sent = os.sendfile(dst, src, copied, min(size - copied, 1 << 30))
                if sent == 0:
                    break
                copied += sent
            return copied
        finally:
            os.close(dst)
    finally:
        os.close(src)


# --- the engine's checkpoint API (experimental in Docker; the SDK has no methods for it) -----------


def checkpoint_create(api: docker.APIClient, container_id: str, name: str) -> None:
    """Checkpoints the container into its own folder; the container stops."""
    response = api._post_json(
        api._url("/containers/{0}/checkpoints", container_id), data={"CheckpointID": name, "Exit": True}
    )
    api._raise_for_status(response)


def checkpoint_start(api: docker.APIClient, container_id: str, name: str) -> None:
    """Starts a stopped container from its checkpoint `name` (in its own folder). The engine
    uploads the checkpoint into containerd's content store first, and that upload fails when a blob
    of it is already there (an identical one an earlier checkpoint left: moby#42900); nothing was
    started then, so the start is tried again."""
    for attempt in range(_START_ATTEMPTS):
        response = api._post(api._url("/containers/{0}/start", container_id), params={"checkpoint": name})
        if attempt + 1 < _START_ATTEMPTS and response.status_code >= 500 and "already exists" in response.text:
            time.sleep(_START_RETRY_S * (attempt + 1))
            continue
        api._raise_for_status(response)
        return


def checkpoint_delete(api: docker.APIClient, container_id: str, name: str) -> None:
    try:
        api._raise_for_status(api._delete(api._url("/containers/{0}/checkpoints/{1}", container_id, name)))
    except docker.errors.APIError:  # gone with its container, or never written
        pass


def checkpoint_commit(
    api: docker.APIClient, store: CheckpointStore, container_id: str, ref: str, labels: Mapping[str, str]
) -> int:
    """The checkpoint snapshot `ref` of a running container (the module's docstring): checkpoint,
    commit, restore, keep. Returns the checkpoint's bytes. The container is restored even when the
    commit fails; CheckpointFailed when it cannot be (it is stopped then), or when the checkpoint
    could not be kept (the image is removed: nothing half made is left)."""
    repository, tag = ref.split(":")
    runtime_state = _runtime_state_of(api, container_id)
    try:
        checkpoint_create(api, container_id, tag)
    except docker.errors.APIError as exc:
        if exc.status_code in (404, 409):  # gone, or not running: the caller's to tell
            raise
        # CRIU that cannot run on this kernel (runc), a runtime that failed: the sandbox runs on.
        raise CheckpointFailed(
            f"container {container_id[:12]} could not be checkpointed: {exc.explanation or exc}"
        ) from None
    if runtime_state is not None:
        _clear_stale_state(*runtime_state, container_id)
    try:
        api.commit(container_id, repository=repository, tag=tag, pause=False, conf={"Labels": dict(labels)})
    finally:
        try:
            checkpoint_start(api, container_id, tag)
        except docker.errors.APIError as exc:
            _forget(api, ref, store, tag)
            raise CheckpointFailed(
                f"container {container_id[:12]} could not be restored after its checkpoint: {exc.explanation or exc}"
            ) from None
    try:
        return store.keep(container_id, tag)
    except (OSError, ValueError) as exc:
        _forget(api, ref, store, tag)
        raise CheckpointFailed(f"the checkpoint of container {container_id[:12]} could not be kept: {exc}") from None
    finally:
        checkpoint_delete(api, container_id, tag)


def _runtime_state_of(api: docker.APIClient, container_id: str) -> tuple[str, str] | None:
    """(runtime binary, its state folder) of a running container, from the runtime's own process on
    this host (its `--root`); None where it cannot be told."""
    container = api.inspect_container(container_id)
    runtime = (container.get("HostConfig") or {}).get("Runtime") or "runc"
    binary = ((api.info().get("Runtimes") or {}).get(runtime) or {}).get("path") or runtime
    try:
        with open(f"/proc/{int(container['State'].get('Pid') or 0)}/cmdline", "rb") as f:
            args = f.read(1 << 16).split(b"\0")
    except (OSError, ValueError):
        return None
    for arg in args:
        if arg.startswith(b"--root="):
            root = os.fsdecode(arg[len(b"--root=") :])
            if os.path.isabs(root) and ".." not in root.split("/") and os.path.isdir(root):
                return shutil.which(binary) or binary, root
    return None


def _clear_stale_state(binary: str, root: str, container_id: str) -> None:
    """runsc (this build) leaves the state of a restored container it checkpointed behind as
    "paused", its sandbox gone; the engine's restore of that container then fails ("id already in
    use"). The runtime's own `delete --force` removes it (and then panics on the status change)."""
    try:
        state = subprocess.run([binary, "--root", root, "state", container_id], capture_output=True, timeout=10)
        if state.returncode != 0:
            return
        found = json.loads(state.stdout)
        pid = int(found.get("pid") or 0)
        if found.get("status") == "running" and pid > 0 and os.path.exists(f"/proc/{pid}"):
            return
        subprocess.run([binary, "--root", root, "delete", "--force", container_id], capture_output=True, timeout=10)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass


def _forget(api: docker.APIClient, ref: str, store: CheckpointStore, tag: str) -> None:
    try:
        api.remove_image(ref, force=True)
    except docker.errors.APIError:  # never made
        pass
    store.drop(tag)


# --- a call's processes under a runtime with a kernel of its own -----------------------------------
# gVisor runs a sandbox's processes in its own kernel: the host sees only the runtime's, so a call
# that outlives its timeout cannot be killed from the host's process table (procs.py). It is killed
# from the sandbox's: one exec lists the processes (the runtime's own /proc, which no process can
# forge; at worst a tampered shell lies about it, and the signals it makes us send can only reach
# this sandbox's processes, whose state is unknown after a timeout anyway), the host picks the
# call's as procs.py does, and another exec kills them, round after round until none is left (this
# runsc build dies of SIGKILL sent to processes it stopped, so they are not frozen first).
_AGENT_WORD = AGENT_NAME.encode()  # argv[3] of the session agent and its subshells
_SIGNAL = 'sig=$1; shift; kill -s "$sig" "$@" 2>/dev/null; exit 0'
_KILL_ROUNDS = 20


def kill_calls_inside(api: docker.APIClient, container_id: str, shell: str, *, agent: bool) -> int:
    """SIGKILL the running call's processes inside the sandbox: an exec'd call's session (a process
    the engine started, not the agent), or the sessions the session agent started (with `agent`,
    the agent's own processes too), their process groups and their descendants. A process that left
    the call's session and tree (a daemon) outlives it, as on the host. Returns how many were killed."""
    killed: set[int] = set()
    for _ in range(_KILL_ROUNDS):
        members = sorted(_call_members(_scan_inside(api, container_id, shell), agent=agent))
        if not members:
            break
        _signal_inside(api, container_id, shell, "KILL", members)
        killed.update(members)
    return len(killed)


def _call_members(procs: list[InsideProcess], *, agent: bool) -> set[int]:
    by_pid = {p.pid: p for p in procs}
    agents = {p.pid for p in procs if _AGENT_WORD in p.argv.split(b"\0")}
    # Started by the engine: an exec, or the agent (with `agent`).
    roots = {p.pid for p in procs if p.ppid == 0 and p.pid != 1 and (agent or p.pid not in agents)}
    for p in procs:  # the topmost sessions below an agent: its calls
        parent = by_pid.get(p.ppid)
        if p.sid == p.pid and parent is not None and parent.pid in agents and parent.sid != p.sid:
            roots.add(p.pid)
    return with_descendants({p.pid for p in procs if p.pid in roots or p.sid in roots or p.pgid in roots}, procs)


def _scan_inside(api: docker.APIClient, container_id: str, shell: str) -> list[InsideProcess]:
    return inside_listing(_exec(api, container_id, [shell, "-c", INSIDE_SCAN]))[0]


def _signal_inside(api: docker.APIClient, container_id: str, shell: str, signal: str, pids: list[int]) -> None:
    _exec(api, container_id, [shell, "-c", _SIGNAL, "kill", signal, *map(str, pids)])


def _exec(api: docker.APIClient, container_id: str, argv: list[str]) -> bytes:
    exec_id = api.exec_create(container_id, argv)["Id"]
    return api.exec_start(exec_id)
