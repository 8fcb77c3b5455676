"""The docker backend: one container per sandbox, driven through the Docker Engine API (docker SDK).

The `bash` tool runs each command in a fresh shell (`docker exec`) that first restores the
previous call's working directory and exported variables from a state folder inside the
container (/.tvcache), and saves them again on exit. Because the state lives in the container's
filesystem, `commit` captures it: a fork resumes the same shell session. The shell starts from
an empty environment (`env -i`), so a variable the agent unsets stays unset.

Containers are confined by the service, not by the task's spec: only the images the operator
allows (never a snapshot image), no network without the operator's grant, memory/CPU/pid limits up
to the operator's maxima (a spec above one is refused), ulimits, an optional non-root user, a disk
quota on the container's own layer, a small capability set, no-new-privileges, a fixed hostname
(outputs must not depend on which container ran them), nothing of the host mounted, and a
keep-alive `sleep` under docker's init so orphans are reaped. A timed-out call is killed from the
host (procs.py).
"""

from __future__ import annotations

import datetime as dt
import enum
import io
import logging
import os
import re
import select
import struct
import tarfile
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import docker
import docker.errors
import requests.exceptions

from .base import (
    OWNER,
    OWNER_LABEL,
    SOURCE_LABEL,
    EngineUnavailable,
    EngineUnreachable,
    ImageNotAllowed,
    InvalidEnv,
    InvalidToolArgs,
    LimitExceeded,
    NetworkNotGranted,
    OwnedResource,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxGone,
    SandboxOverQuota,
    SandboxTampered,
    SnapshotInfo,
    SnapshotMissing,
    ToolSpec,
    UserNotAllowed,
    check_env_keys,
    check_labels,
    require_str,
)
from .config import DockerConfig
from .folders import TreeUsage, tree_usage
from .hostfs import StateDigest
from .overlay import LayerState, LayerTooLarge, LayerWatch, SessionTampered, restore_file_times, settle_after
from .procs import host_sees, kill_call_tree

log = logging.getLogger(__name__)

# Bump when the bash tool's behaviour changes: it is part of the env fingerprint.
TOOLS_VERSION = 3
SHELL_LABEL = "tvcache.shell"
KIND_LABEL = "tvcache.kind"
SNAPSHOT_REPOSITORY = "tvcache/snapshot"
_SNAPSHOT_REF = re.compile(re.escape(SNAPSHOT_REPOSITORY) + r":[0-9a-f]{32}")
_ENV_KEYS = frozenset({"backend", "image", "network", "limits", "workdir", "user"})
_LIMIT_KEYS = frozenset({"memory_mb", "cpus", "pids"})
_USER = re.compile(r"(\d{1,9})(?::(\d{1,9}))?")
# A non-root user's home and default working directory, made by the service in a fresh container.
_HOME = "/home/sandbox"
_KEEPALIVE = ["sleep", "2147483647"]
# Docker's default set minus raw sockets, mknod, chroot, audit and file capabilities.
_CAPABILITIES = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP", "NET_BIND_SERVICE"]
# One argument of execve is capped at 128 KiB by Linux.
_MAX_COMMAND_BYTES = 128 * 1024 - 1
_KILL_GRACE_S = 5.0
# A layer of fewer entries than this (a measure of some 50 ms) is measured after every call; a
# larger one every disk_check_s, stretched to this many times what its measure costs.
_DISK_CHEAP_ENTRIES = 5_000
_DISK_COST_FACTOR = 20
_DISK_MAX_DEPTH = 128  # folders nested deeper count as over the quota: the measure cannot see them
_DEATH_SETTLE_S = 0.25
_UNSET = object()
_ENGINE_DOWN = (requests.exceptions.ConnectionError, requests.exceptions.Timeout)

STATE_DIR = "/.tvcache"
_SESSION_FILES = ("env.sh", "cwd")  # what calls keep of the shell session
# Run once in a fresh sandbox: seed the session state from the image's environment and working
# directory, and say whether bash exists (the busybox image only has ash).
# The variables are exported in the calls' shell's own syntax, so a first call changes nothing.
_INIT_SCRIPT = f"""mkdir -p {STATE_DIR} && pwd > {STATE_DIR}/cwd && if __tvc_bash=$(command -v bash); then
"$__tvc_bash" -c 'unset OLDPWD; export -p' > {STATE_DIR}/env.sh && echo "$__tvc_bash"; else export -p > {STATE_DIR}/env.sh; fi"""
# Run per call as `env -i SHELL -c _CALL_SCRIPT SHELL COMMAND`. Docker starts each exec as a
# session and group leader: a timeout kills that session from the host (procs.py).
_CALL_SCRIPT = f""". {STATE_DIR}/env.sh
IFS= read -r __tvc_cwd < {STATE_DIR}/cwd
if [ "${{OLDPWD+set}}" ]; then __tvc_old=$OLDPWD; else unset __tvc_old; fi
cd "$__tvc_cwd" 2>/dev/null || cd /
if [ "${{__tvc_old+set}}" ]; then OLDPWD=$__tvc_old; else unset OLDPWD; fi
trap '__tvc_rc=$?; export -p > {STATE_DIR}/env.sh; pwd > {STATE_DIR}/cwd; exit $__tvc_rc' EXIT
__tvc_cmd=$1
set --
eval "unset __tvc_cwd __tvc_cmd __tvc_old
$__tvc_cmd"
"""


@dataclass(frozen=True)
class DockerEnv:
    """A task's docker env spec, validated against the operator's grants, with the service
    defaults filled in. Refusals: InvalidEnv (malformed), NotGranted subclasses (above a grant)."""

    image: str
    network: bool
    memory_mb: int
    cpus: float
    pids: int
    workdir: str | None
    user: str  # "uid:gid", or "" for the image's own user
    ulimits: tuple[tuple[str, int], ...]
    disk_mb: int

    @classmethod
    def parse(cls, env: Mapping[str, Any], config: DockerConfig) -> DockerEnv:
        check_env_keys(env, _ENV_KEYS)
        limits = env.get("limits") or {}
        if not isinstance(limits, Mapping) or set(limits) - _LIMIT_KEYS:
            raise InvalidEnv(f'"limits" may only set {sorted(_LIMIT_KEYS)}')
        parsed = cls(
            image=env.get("image") or config.default_image,
            network=env.get("network", False),
            # The defaults, within the maxima: an operator who lowers a maximum lowers the default.
            memory_mb=limits.get("memory_mb", min(config.memory_mb, config.max_memory_mb)),
            cpus=limits.get("cpus", min(config.cpus, config.max_cpus)),
            pids=limits.get("pids", min(config.pids, config.max_pids)),
            workdir=env.get("workdir"),
            user=_user(env.get("user", config.user), config),
            ulimits=_ulimits(config),
            disk_mb=config.disk_mb,
        )
        parsed._check(config)
        return parsed

    def _check(self, config: DockerConfig) -> None:
        if not isinstance(self.image, str) or not isinstance(self.network, bool):
            raise InvalidEnv('"image" must be a string and "network" a boolean')
        if self.workdir is not None and not (isinstance(self.workdir, str) and self.workdir.startswith("/")
                                             and "\x00" not in self.workdir and len(self.workdir) <= 4096):
            raise InvalidEnv('"workdir" must be an absolute path')
        for name in ("memory_mb", "cpus", "pids"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidEnv(f"limits.{name} must be a positive number")
            if name != "cpus" and not isinstance(value, int):
                raise InvalidEnv(f"limits.{name} must be an integer")
            most = getattr(config, f"max_{name}")
            if not value <= most:
                raise LimitExceeded(f"limits.{name} may be at most {most} on this service",
                                    details={"limit": name, "requested": value, "max": most})
        if self.network and not config.allow_network:
            raise NetworkNotGranted("network access is not granted on this service (TVCACHE_DOCKER_ALLOW_NETWORK)")
        allowed = allowed_images(config)
        if _SNAPSHOT_REF.fullmatch(_image_name(self.image)) or _image_name(self.image) not in allowed:
            raise ImageNotAllowed(f"image {self.image!r} is not one this service runs (TVCACHE_DOCKER_IMAGES)",
                                  details={"allowed": sorted(allowed)})

    def limits(self) -> dict[str, Any]:
        return {"memory_mb": self.memory_mb, "cpus": self.cpus, "pids": self.pids}

    def confinement(self) -> dict[str, Any]:
        """What the service imposes beyond the task's limits; tool results can depend on it (`id`,
        `ulimit -a`, a write past the quota), so it is part of the env fingerprint."""
        return {"user": self.user, "ulimits": dict(self.ulimits), "disk_mb": self.disk_mb}

    @property
    def non_root(self) -> bool:
        return bool(self.user) and not self.user.startswith("0:")


def allowed_images(config: DockerConfig) -> frozenset[str]:
    """The operator's images, by normalized name; snapshot images never, whatever the list says."""
    names = {_image_name(image) for image in (*config.images, config.default_image)}
    return frozenset(name for name in names if not _SNAPSHOT_REF.fullmatch(name))


def _image_name(image: str) -> str:
    """`name` and `name:latest` are one image; a digest or a tag is kept as given."""
    if "@" in image or ":" in image.rsplit("/", 1)[-1]:
        return image
    return f"{image}:latest"


def _user(value: Any, config: DockerConfig) -> str:
    """ "uid[:gid]" (numeric: names would need the image's passwd) as "uid:gid"; "" is the image's
    user. A non-root operator default is a floor: a task may name another non-root user only."""
    if not isinstance(value, str) or (value and not _USER.fullmatch(value)):
        raise InvalidEnv('"user" must be a numeric "uid" or "uid:gid"')
    if value:
        uid, gid = _USER.fullmatch(value).groups()
        value = f"{int(uid)}:{int(gid if gid is not None else uid)}"
    floor = _USER.fullmatch(config.user)
    if floor and int(floor.group(1)) != 0 and (not value or value.startswith("0:")):
        raise UserNotAllowed("this service runs sandboxes as a non-root user (TVCACHE_DOCKER_USER)",
                             details={"user": config.user})
    return value


def _ulimits(config: DockerConfig) -> tuple[tuple[str, int], ...]:
    fsize_mb = config.ulimit_fsize_mb or config.disk_mb
    limits = (("nofile", config.ulimit_nofile), ("nproc", config.ulimit_nproc), ("fsize", fsize_mb * 2**20))
    return tuple((name, value) for name, value in limits if value > 0)


class StartLimiter:
    """Caps concurrent container creations: past the engine's saturation point every start slows."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._slots = threading.BoundedSemaphore(capacity)
        self._lock = threading.Lock()
        self.in_flight = 0

    @contextmanager
    def slot(self) -> Iterator[None]:
        with self._slots:
            with self._lock:
                self.in_flight += 1
            try:
                yield
            finally:
                with self._lock:
                    self.in_flight -= 1


@contextmanager
def engine_errors() -> Iterator[None]:
    """Turns a dead or unreachable engine into EngineUnavailable; API errors pass through."""
    try:
        yield
    except _ENGINE_DOWN as exc:
        raise EngineUnavailable(f"docker engine unreachable: {exc}") from exc


class _Stop(enum.Enum):
    EOF = "eof"
    DEADLINE = "deadline"
    FLOOD = "flood"


class _Output:
    """stdout/stderr of one call, each kept up to `cap` bytes."""

    def __init__(self, cap: int):
        self.cap = cap
        self.streams = {1: bytearray(), 2: bytearray()}
        self.received = 0
        self.truncated = False

    def add(self, stream: int, data: bytes) -> None:
        self.received += len(data)
        kept = self.streams.get(stream)
        if kept is None:
            return
        room = self.cap - len(kept)
        if len(data) > room:
            self.truncated = True
        kept += data[: max(room, 0)]

    def text(self, stream: int) -> str:
        return self.streams[stream].decode("utf-8", errors="replace")


def _read_ahead(sock: Any) -> bytes:
    """The stream's first bytes that the HTTP client already buffered while it read the response
    headers. docker-py hands out the raw socket under that buffer: a short call's whole output
    can sit in it, and reading only the socket would lose it (seen under load: `echo` printing
    nothing). Read without blocking, so an empty buffer costs nothing."""
    response = getattr(sock, "_response", None)
    buffered = getattr(getattr(getattr(response, "raw", None), "_fp", None), "fp", None)
    raw_socket = getattr(sock, "_sock", None)
    if buffered is None or raw_socket is None or not hasattr(buffered, "read1"):
        return b""
    timeout = raw_socket.gettimeout()
    raw_socket.setblocking(False)
    try:
        return buffered.read1(65536) or b""
    except BlockingIOError:
        return b""
    finally:
        raw_socket.settimeout(timeout)


class _ExecStream:
    """Reads docker's multiplexed exec stream: frames of 8-byte header (stream, 0, 0, 0, size) + data."""

    def __init__(self, sock: Any):
        self._sock = sock
        self._recv = getattr(sock, "recv", None) or sock.read
        self._buffer = bytearray(_read_ahead(sock))

    def pump(self, output: _Output, deadline: float, flood_bytes: int) -> _Stop:
        self._drain(output)  # frames read ahead with the response headers
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return _Stop.DEADLINE
            # TLS sockets may hold decrypted bytes that select() cannot see.
            pending = getattr(self._sock, "pending", lambda: 0)()
            if not pending and not select.select([self._sock], [], [], remaining)[0]:
                return _Stop.DEADLINE
            data = self._recv(65536)
            if not data:
                return _Stop.EOF
            self._buffer += data
            self._drain(output)
            if output.received > flood_bytes:
                return _Stop.FLOOD

    def _drain(self, output: _Output) -> None:
        offset = 0
        while len(self._buffer) - offset >= 8:
            stream, size = struct.unpack_from(">BxxxL", self._buffer, offset)
            if len(self._buffer) - offset - 8 < size:
                break
            output.add(stream, bytes(self._buffer[offset + 8 : offset + 8 + size]))
            offset += 8 + size
        del self._buffer[:offset]

    def close(self) -> None:
        # Closing the HTTP response closes the socket under it; closing the socket first breaks it.
        response = getattr(self._sock, "_response", None)
        (response or self._sock).close()


class DockerSandbox(Sandbox):
    def __init__(self, backend: DockerBackend, container_id: str, *, shell: str, image_size: int):
        self.sandbox_id = container_id
        self._backend = backend
        self._shell = shell
        self._image_size = image_size  # snapshots report only what the sandbox added to its image
        # One shell session: calls run one at a time, and a snapshot never lands mid-call.
        self._lock = threading.Lock()
        self._watch: LayerWatch | None | object = _UNSET
        self._layer: LayerState | None = None  # the layer as the last observed call left it
        self._last_end_ns = 0  # when the last call ended: the next starts a file-time tick later
        self._stopped = False
        self._quota = _DiskQuota(backend.config)
        if self._quota.limit_bytes:
            backend.disk_watch.add(self)

    def execute(self, tool: str, args: Mapping[str, Any]) -> dict[str, Any]:
        command, timeout_s = self._parse(tool, args)
        with self._lock, engine_errors():
            self._layer = None  # not observed: the next observed call lists the layer before it runs
            return self._run(command, timeout_s)

    def execute_observed(self, tool: str, args: Mapping[str, Any]) -> tuple[dict[str, Any], bool | None]:
        """Observed from the container's layer on the host (overlay.py), when it is in reach."""
        command, timeout_s = self._parse(tool, args)
        with self._lock:
            before = self._layer or self._layer_state()
            self._layer = None  # unknown until the call is over
            if before is not None:
                LayerWatch.settle(before)
            with engine_errors():
                result = self._run(command, timeout_s)
            if before is None:
                return result, None
            self._layer = self._layer_state()
            return result, None if self._layer is None else self._layer.digest != before.digest

    def state_fingerprint(self) -> StateDigest | None:
        with self._lock:
            watch = self._layer_watch()
            if watch is None:
                return None
            try:
                return watch.fingerprint(self._backend.base_layers(self.sandbox_id),
                                         max_bytes=self._backend.config.fingerprint_max_bytes)
            except SessionTampered as exc:
                raise SandboxTampered(str(exc)) from None
            except (LayerTooLarge, OSError):  # too large to fingerprint, or the container is going
                return None

    def _layer_state(self) -> LayerState | None:
        """The layer as it is now; None when it is not observed: out of reach, gone (the container
        is being removed), or too large to list per call (then never again). A sandbox that
        replaced its session files with links or FIFOs raises SandboxTampered."""
        watch = self._layer_watch()
        if watch is None:
            return None
        try:
            return watch.state()
        except SessionTampered as exc:
            raise SandboxTampered(str(exc)) from None
        except LayerTooLarge:
            self._watch = None
        except OSError:
            pass
        return None

    def _parse(self, tool: str, args: Mapping[str, Any]) -> tuple[str, float]:
        self._backend.tool_spec(tool)
        command = require_str(args, "command")
        timeout_s = self._timeout(args)
        if "\x00" in command or len(command.encode("utf-8")) > _MAX_COMMAND_BYTES:
            raise InvalidToolArgs(f"command must be at most {_MAX_COMMAND_BYTES} bytes without NUL characters")
        return command, timeout_s

    def _layer_watch(self) -> LayerWatch | None:
        if self._watch is _UNSET:
            config = self._backend.config
            if not config.observe_writes:
                self._watch = None
                return None
            with engine_errors():
                container = self._gone_if_missing(self._backend.api.inspect_container, self.sandbox_id)
            self._watch = LayerWatch.of(container, session=(STATE_DIR.lstrip("/"), _SESSION_FILES),
                                        max_entries=config.observe_max_entries)
        return self._watch

    def _timeout(self, args: Mapping[str, Any]) -> float:
        config = self._backend.config
        timeout_s = args.get("timeout_s", config.default_timeout_s)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise InvalidToolArgs('"timeout_s" must be a positive number', details={"field": "timeout_s"})
        return min(float(timeout_s), config.max_timeout_s)

    def _run(self, command: str, timeout_s: float) -> dict[str, Any]:
        config = self._backend.config
        api = self._backend.api
        self._raise_if_over_quota()
        settle_after(self._last_end_ns)  # calls (and replays) a file-time tick apart, as live ones are
        deadline = time.monotonic() + timeout_s
        argv = ["env", "-i", self._shell, "-c", _CALL_SCRIPT, self._shell, command]
        try:
            exec_id = self._gone_if_missing(api.exec_create, self.sandbox_id, argv)["Id"]
        except _ENGINE_DOWN as exc:  # nothing ran yet
            raise EngineUnreachable(f"docker engine unreachable: {exc}") from exc
        stream = _ExecStream(self._gone_if_missing(api.exec_start, exec_id, socket=True))
        output = _Output(config.output_cap_bytes)
        try:
            stop = stream.pump(output, deadline, config.output_kill_bytes)
            if stop is not _Stop.EOF:
                self._kill_call(exec_id)
                stream.pump(output, time.monotonic() + _KILL_GRACE_S, float("inf"))
        except OSError as exc:  # the hijacked connection broke: engine or container went away
            self._raise_if_gone()
            raise EngineUnavailable(f"exec stream broke: {exc}") from exc
        finally:
            stream.close()
            self._last_end_ns = time.time_ns()
        exit_code = self._exit_code(exec_id, time.monotonic() + _KILL_GRACE_S)
        if exit_code is None or exit_code >= 128:  # signalled: maybe by the container's death
            self._raise_if_gone()
        self.check_disk(after_call=True)
        return {
            "stdout": output.text(1),
            "stderr": output.text(2),
            "exit_code": exit_code,
            "timed_out": stop is _Stop.DEADLINE,
            "truncated": output.truncated or stop is _Stop.FLOOD,
        }

    def _kill_call(self, exec_id: str) -> None:
        """Kills the call's session and process tree from the host (procs.py). Where the engine's
        processes are out of this host's view (a remote engine), the container is killed instead:
        nothing inside it is trusted to do the killing."""
        api = self._backend.api
        init_pid = self._gone_if_missing(api.inspect_container, self.sandbox_id)["State"].get("Pid") or 0
        if host_sees(self.sandbox_id, init_pid):
            pid = self._exec_pid(exec_id, time.monotonic() + _KILL_GRACE_S)
            if pid:
                kill_call_tree(pid, self.sandbox_id)
            return
        log.warning("container %s: its processes are out of this host's view; killing the container to end a call",
                    self.sandbox_id[:12])
        self._gone_if_missing(api.kill, self.sandbox_id)

    def _exec_pid(self, exec_id: str, deadline: float) -> int:
        """The call's host pid; 0 once it has ended. On a loaded engine a call can still be starting
        when its deadline passes: until it runs, its pid is 0 and it has no exit code."""
        while True:
            state = self._gone_if_missing(self._backend.api.exec_inspect, exec_id)
            if state.get("Pid") or state.get("ExitCode") is not None or time.monotonic() > deadline:
                return state.get("Pid") or 0
            time.sleep(0.01)

    def _exit_code(self, exec_id: str, deadline: float) -> int | None:
        # The stream can end a moment before the engine records the exit code.
        while True:
            state = self._backend.api.exec_inspect(exec_id)
            if not state["Running"]:
                return state["ExitCode"]
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)

    def _gone_if_missing(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except docker.errors.NotFound as exc:
            self._raise_if_over_quota()
            raise SandboxGone(f"container {self.sandbox_id[:12]} no longer exists") from exc
        except docker.errors.APIError as exc:
            if exc.status_code == 409:  # "container ... is not running"
                self._raise_if_over_quota()
                raise SandboxGone(f"container {self.sandbox_id[:12]} is not running: {exc.explanation}") from exc
            raise SandboxError(f"docker exec failed: {exc.explanation}") from exc

    def _raise_if_gone(self) -> None:
        # The engine marks a killed container as exited a moment after its processes died, so a
        # signalled call gets a short grace to tell "the command was killed" from "the sandbox was".
        settle = time.monotonic() + _DEATH_SETTLE_S
        while self.alive():
            if time.monotonic() > settle:
                return
            time.sleep(0.02)
        self._raise_if_over_quota()
        raise SandboxGone(f"container {self.sandbox_id[:12]} died during the call")

    def check_disk(self, *, after_call: bool = False) -> None:
        """Measures the container's layer when it is due (after every call while that is cheap).
        Past the quota the container is killed and SandboxOverQuota raised, now and by every later
        call; it is removed at once unless a call runs (that call removes it as it fails)."""
        if self._quota.measure(self, after_call=after_call):
            log.warning("container %s is over its disk quota: %s", self.sandbox_id[:12], self._quota.breach)
            with engine_errors():
                try:
                    self._backend.api.kill(self.sandbox_id)
                except docker.errors.APIError:  # not running, or gone already
                    pass
        if self._quota.breach is None:  # else found now, or by the watch while the call ran
            return
        if after_call:  # the caller holds the lock
            self._raise_if_over_quota()
        elif self._lock.acquire(blocking=False):
            try:
                self._raise_if_over_quota()
            finally:
                self._lock.release()

    def _raise_if_over_quota(self) -> None:
        if self._quota.breach is None:
            return
        self._backend.disk_watch.discard(self)
        self._backend.remove_sandbox(self.sandbox_id)
        self._stopped = True
        raise SandboxOverQuota(f"sandbox removed: {self._quota.breach}", details=self._quota.details())

    def layer_dir(self) -> str | None:
        """The container's own layer on this host (overlay2's upper directory), or None: out of reach."""
        with engine_errors():
            container = self._gone_if_missing(self._backend.api.inspect_container, self.sandbox_id)
        driver = container.get("GraphDriver") or {}
        upper = (driver.get("Data") or {}).get("UpperDir")
        if driver.get("Name") != "overlay2" or not upper or not os.access(upper, os.R_OK | os.X_OK):
            return None
        return upper

    def snapshot(self, *, labels: Mapping[str, str] | None = None) -> SnapshotInfo:
        ref = f"{SNAPSHOT_REPOSITORY}:{uuid.uuid4().hex}"
        repository, tag = ref.split(":")
        snapshot_labels = {
            **check_labels(labels or {}),
            OWNER_LABEL: OWNER,
            KIND_LABEL: "snapshot",
            SOURCE_LABEL: self.sandbox_id,
            SHELL_LABEL: self._shell,  # forks run calls under the same shell without probing
        }
        with self._lock, engine_errors():
            started = time.perf_counter()
            # pause=False: the sandbox keeps running; calls are held off by the lock instead.
            self._gone_if_missing(
                self._backend.api.commit, self.sandbox_id, repository=repository, tag=tag, pause=False, conf={"Labels": snapshot_labels}
            )
            image = self._backend.api.inspect_image(ref)
            self._restore_file_times(image)
            create_ms = (time.perf_counter() - started) * 1000
            size = image["Size"]
        return SnapshotInfo(ref=ref, size_bytes=max(size - self._image_size, 0), create_ms=create_ms)

    def _restore_file_times(self, image: Mapping[str, Any]) -> None:
        """The commit kept whole seconds of every file time (overlay.restore_file_times): write
        the exact ones into the new layer before any fork runs on it."""
        watch = self._layer_watch()
        target = ((image.get("GraphDriver") or {}).get("Data") or {}).get("UpperDir")
        if watch is None or not target:
            return
        try:
            restore_file_times(watch.upper, target, max_entries=self._backend.config.observe_max_entries)
        except (OSError, LayerTooLarge):  # the fingerprint check catches a fork whose times differ
            pass

    def stop(self) -> None:
        self._backend.disk_watch.discard(self)
        if not self._stopped:
            self._backend.remove_sandbox(self.sandbox_id)
            self._stopped = True

    def alive(self) -> bool:
        with engine_errors():
            try:
                return bool(self._backend.api.inspect_container(self.sandbox_id)["State"]["Running"])
            except docker.errors.NotFound:
                return False


class DockerBackend(SandboxBackend):
    name = "docker"
    tools = {"bash": ToolSpec(mutates_state=True)}

    def audit_view(self, tool: str, result: Mapping[str, Any]) -> Any:
        """What the agent reads of a bash call; a call that timed out was cut short at a moment
        that proves nothing about the tool."""
        if result.get("timed_out"):
            return None
        return {key: result.get(key) for key in ("stdout", "stderr", "exit_code")}

    def __init__(self, config: DockerConfig = DockerConfig()):
        self.config = config
        self.limiter = StartLimiter(config.max_concurrent_starts)
        self.disk_watch = _DiskWatch(config.disk_check_s)
        # Whether the engine enforces an overlay size limit (--storage-opt size): None until tried.
        self.storage_quota: bool | None = None
        self._client: docker.DockerClient | None = None
        self._client_lock = threading.Lock()
        self._base_layers: dict[str, frozenset[str]] = {}  # by image id: images never change

    @property
    def api(self) -> docker.APIClient:
        return self.client.api

    @property
    def client(self) -> docker.DockerClient:
        """Connected on first use, so a backend can be built while the engine is still down."""
        with self._client_lock:
            if self._client is None:
                options = {"version": "auto", "timeout": self.config.api_timeout_s, "max_pool_size": self.config.api_pool_size}
                try:
                    if self.config.base_url:
                        self._client = docker.DockerClient(base_url=self.config.base_url, **options)
                    else:
                        self._client = docker.from_env(**options)
                except docker.errors.DockerException as exc:
                    where = self.config.base_url or "DOCKER_HOST / the default socket"
                    raise EngineUnavailable(f"cannot reach the docker engine at {where}: {exc}") from exc
            return self._client

    def start(self, env: Mapping[str, Any], *, labels: Mapping[str, str]) -> DockerSandbox:
        spec = DockerEnv.parse(env, self.config)
        with engine_errors():
            image = self._image(spec.image, missing=InvalidEnv(f"image {spec.image!r} not found (build it: manage.py build_images)"))
            with self.limiter.slot():
                container_id = self._create(spec, image, labels)
                try:
                    probed = self._init_session(container_id)
                except BaseException:
                    self._discard(container_id)
                    raise
        shell = (image["Config"].get("Labels") or {}).get(SHELL_LABEL) or probed
        return DockerSandbox(self, container_id, shell=shell, image_size=image["Size"])

    def fork(self, ref: str, env: Mapping[str, Any], *, labels: Mapping[str, str]) -> DockerSandbox:
        spec = DockerEnv.parse(env, self.config)
        if not _SNAPSHOT_REF.fullmatch(ref):
            raise SnapshotMissing(f"not a docker snapshot ref: {ref!r}")
        with engine_errors():
            image = self._image(ref, missing=SnapshotMissing(f"snapshot {ref} does not exist"))
            with self.limiter.slot():
                container_id = self._create(spec, image, labels)
        # The fork's own snapshots are measured against the snapshot image it runs from.
        return DockerSandbox(self, container_id, shell=image["Config"]["Labels"][SHELL_LABEL], image_size=image["Size"])

    def attach(self, sandbox_id: str) -> DockerSandbox:
        with engine_errors():
            try:
                container = self.api.inspect_container(sandbox_id)
            except docker.errors.NotFound:
                raise SandboxGone(f"container {sandbox_id} does not exist") from None
            if not container["State"]["Running"] or (container["Config"].get("Labels") or {}).get(OWNER_LABEL) != OWNER:
                raise SandboxGone(f"container {sandbox_id} is not a running tvcache sandbox")
            image = self.api.inspect_image(container["Image"])
            shell = (image["Config"].get("Labels") or {}).get(SHELL_LABEL) or self._probe_shell(sandbox_id)
        return DockerSandbox(self, container["Id"], shell=shell, image_size=image["Size"])

    def base_layers(self, container_id: str) -> frozenset[str]:
        """The layer folders of the base image a sandbox runs on (below its snapshots' layers)."""
        with engine_errors():
            image_id = self.api.inspect_container(container_id)["Image"]
        found = self._base_layers.get(image_id)
        if found is None:
            image = self.api.inspect_image(image_id)
            while ((image["Config"].get("Labels") or {}).get(KIND_LABEL) == "snapshot" and image.get("Parent")):
                image = self.api.inspect_image(image["Parent"])
            data = (image.get("GraphDriver") or {}).get("Data") or {}
            found = frozenset(d for d in [data.get("UpperDir"), *(data.get("LowerDir") or "").split(":")] if d)
            self._base_layers[image_id] = found
        return found

    def _probe_shell(self, container_id: str) -> str:
        exec_id = self.api.exec_create(container_id, ["/bin/sh", "-c", "command -v bash || true"])["Id"]
        return self.api.exec_start(exec_id).decode("utf-8", errors="replace").strip() or "/bin/sh"

    def delete_snapshot(self, ref: str) -> None:
        if not _SNAPSHOT_REF.fullmatch(ref):
            return
        with engine_errors():
            try:
                # force: untag even while forks run from it; the image goes with the last fork.
                self.api.remove_image(ref, force=True)
            except docker.errors.NotFound:
                pass

    def fingerprint_material(self, env: Mapping[str, Any]) -> dict[str, Any]:
        spec = DockerEnv.parse(env, self.config)
        with engine_errors():
            image = self._image(spec.image, missing=InvalidEnv(f"image {spec.image!r} not found (build it: manage.py build_images)"))
        return {"backend": self.name, "tools_version": TOOLS_VERSION, "image_id": image["Id"], "limits": spec.limits(),
                "confinement": spec.confinement()}

    def health(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"max_concurrent_starts": self.limiter.capacity, "starts_in_flight": self.limiter.in_flight,
                                 # True: the engine enforces it (overlay size); False: the layer is watched
                                 "disk_quota_mb": self.config.disk_mb, "storage_quota": self.storage_quota}
        try:
            with engine_errors():
                version = self.api.version()
                running = self.api.containers(filters={"label": [f"{OWNER_LABEL}={OWNER}", f"{KIND_LABEL}=sandbox"]}, quiet=True)
        except (SandboxError, docker.errors.DockerException) as exc:
            return {"ok": False, "error": str(exc), **facts}
        return {
            "ok": True,
            "engine_version": version.get("Version"),
            "api_version": version.get("ApiVersion"),
            "running_sandboxes": len(running),
            **facts,
        }

    def list_sandboxes(self, label_selector: Mapping[str, str] | None = None) -> list[OwnedResource]:
        with engine_errors():
            found = self.api.containers(all=True, filters={"label": _label_filter("sandbox", label_selector)})
        return [_owned(c["Id"], c.get("Labels"), c.get("Created")) for c in found]

    def list_snapshots(self, label_selector: Mapping[str, str] | None = None) -> list[OwnedResource]:
        with engine_errors():
            found = self.api.images(filters={"label": _label_filter("snapshot", label_selector)})
        # Untagged snapshot images were deleted and only wait for their last fork to go.
        return [
            _owned(tag, image.get("Labels"), image.get("Created"))
            for image in found
            for tag in image.get("RepoTags") or ()
            if _SNAPSHOT_REF.fullmatch(tag)
        ]

    def remove_sandbox(self, sandbox_id: str) -> None:
        with engine_errors():
            self._discard(sandbox_id)

    def _image(self, ref: str, *, missing: SandboxError) -> dict[str, Any]:
        try:
            return self.api.inspect_image(ref)
        except docker.errors.ImageNotFound:
            raise missing from None

    def _create(self, spec: DockerEnv, image: dict[str, Any], labels: Mapping[str, str]) -> str:
        fresh = (image["Config"].get("Labels") or {}).get(KIND_LABEL) != "snapshot"  # a fork's image has it all
        container_id = self._create_container(spec, image, labels)
        try:
            if spec.non_root and fresh:
                self.api.put_archive(container_id, "/", _user_folders(spec.user))
            self.api.start(container_id)
        except BaseException:
            self._discard(container_id)
            raise
        return container_id

    def _create_container(self, spec: DockerEnv, image: dict[str, Any], labels: Mapping[str, str]) -> str:
        """Created with an overlay size limit where the engine can enforce one (overlay2 on xfs
        with pquota); an engine that refuses it is asked once per backend, then no longer."""
        if spec.disk_mb and self.storage_quota is not False:
            try:
                container_id = self._create_with(spec, image, labels, storage_opt={"size": f"{spec.disk_mb}M"})
            except docker.errors.APIError as exc:
                if "storage-opt" not in str(exc.explanation or exc):
                    raise
                self.storage_quota = False
            else:
                self.storage_quota = True
                return container_id
        return self._create_with(spec, image, labels, storage_opt=None)

    def _create_with(self, spec: DockerEnv, image: dict[str, Any], labels: Mapping[str, str],
                     storage_opt: dict[str, str] | None) -> str:
        host_config = self.api.create_host_config(
            network_mode="bridge" if spec.network else "none",
            mem_limit=f"{spec.memory_mb}m",
            memswap_limit=f"{spec.memory_mb}m",  # no swap on top
            nano_cpus=int(spec.cpus * 1e9),
            pids_limit=spec.pids,
            ulimits=[docker.types.Ulimit(name=name, soft=value, hard=value) for name, value in spec.ulimits],
            storage_opt=storage_opt,
            cap_drop=["ALL"],
            cap_add=_CAPABILITIES,
            security_opt=["no-new-privileges"],
            privileged=False,
            init=True,
        )
        return self.api.create_container(
            # By id: the image the caller inspected (and fingerprinted), even if the tag moved since.
            image=image["Id"],
            command=_KEEPALIVE,
            hostname="sandbox",
            user=spec.user or None,
            working_dir=spec.workdir or (_HOME if spec.non_root else None),
            environment={"HOME": _HOME} if spec.non_root else None,
            labels=_container_labels(image, check_labels(labels)),
            host_config=host_config,
        )["Id"]

    def _init_session(self, container_id: str) -> str:
        """Writes the first session state; returns the shell that calls will run under."""
        exec_id = self.api.exec_create(container_id, ["/bin/sh", "-c", _INIT_SCRIPT])["Id"]
        out = self.api.exec_start(exec_id).decode("utf-8", errors="replace").strip()
        if self.api.exec_inspect(exec_id)["ExitCode"] != 0:
            raise SandboxError(f"could not initialise the shell session: {out[-500:]}")
        return out or "/bin/sh"

    def _discard(self, container_id: str) -> None:
        try:
            container = self.api.inspect_container(container_id)
        except docker.errors.NotFound:
            return
        if container["Config"].get("Labels", {}).get(OWNER_LABEL) != OWNER:
            raise SandboxError(f"container {container_id[:12]} is not a tvcache sandbox")
        try:
            self.api.remove_container(container_id, force=True)
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as exc:
            # Two stoppers at once (a rollout's end and the reaper): the other one removes it.
            if exc.status_code == 409 and "already in progress" in str(exc.explanation):
                return
            raise
        self._drop_if_deleted_snapshot(container["Image"])

    def _drop_if_deleted_snapshot(self, image_id: str) -> None:
        """A deleted snapshot stays as an untagged image while forks run from it; the last one drops it."""
        try:
            image = self.api.inspect_image(image_id)
            labels = image["Config"].get("Labels") or {}
            if labels.get(KIND_LABEL) == "snapshot" and not image.get("RepoTags"):
                self.api.remove_image(image_id)
        except docker.errors.APIError:  # gone already, or still used by another fork
            pass


class _DiskQuota:
    """A sandbox's disk quota, measured on its container's layer from the host (folders.tree_usage:
    no link is followed). A measure costs about 10 us per entry of the layer, so a large layer is
    measured less often. Between measures a sandbox can overshoot by what it writes meanwhile;
    the fsize ulimit keeps any one file under the quota."""

    def __init__(self, config: DockerConfig):
        self.limit_bytes = config.disk_mb * 2**20
        self.max_files = config.disk_max_files
        self.interval_s = config.disk_check_s
        self.breach: str | None = None
        self.usage: TreeUsage | None = None
        self._layer: str | None | object = _UNSET
        self._due = 0.0
        self._lock = threading.Lock()

    def measure(self, sandbox: DockerSandbox, *, after_call: bool) -> bool:
        """Whether this measure found the layer past the quota (once: later ones return False)."""
        if not self.limit_bytes or self.breach is not None:
            return False
        with self._lock:
            started = time.monotonic()
            cheap = self.usage is None or self.usage.entries < _DISK_CHEAP_ENTRIES
            if self.breach is not None or (started < self._due and not (after_call and cheap)):
                return False
            if self._layer is _UNSET:
                self._layer = sandbox.layer_dir()
            if self._layer is None:
                return False
            try:
                usage = tree_usage(self._layer, stop_bytes=self.limit_bytes, stop_entries=self.max_files,
                                   max_depth=_DISK_MAX_DEPTH)
            except FileNotFoundError:  # the container was removed
                return False
            cost_s = time.monotonic() - started
            self._due = time.monotonic() + max(self.interval_s, _DISK_COST_FACTOR * cost_s)
            self.usage, self.breach = usage, self._breach(usage)
            return self.breach is not None

    def _breach(self, usage: TreeUsage) -> str | None:
        if usage.bytes > self.limit_bytes:
            return f"it wrote more than its disk quota of {self.limit_bytes // 2**20} MB"
        if usage.entries > self.max_files:
            return f"it made more than {self.max_files} files"
        if usage.too_deep:
            return f"it nested folders more than {_DISK_MAX_DEPTH} deep"
        return None

    def details(self) -> dict[str, Any]:
        usage = self.usage or TreeUsage(0, 0)
        return {"disk_mb": self.limit_bytes // 2**20, "max_files": self.max_files, "layer_bytes": usage.bytes,
                "layer_files": usage.entries}


class _DiskWatch:
    """One thread per backend measures the layers of the sandboxes this process holds, between their
    calls and during long ones; it ends when none is left."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._sandboxes: weakref.WeakSet[DockerSandbox] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, sandbox: DockerSandbox) -> None:
        with self._lock:
            self._sandboxes.add(sandbox)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tvcache-disk-quota", daemon=True)
                self._thread.start()

    def discard(self, sandbox: DockerSandbox) -> None:
        with self._lock:
            self._sandboxes.discard(sandbox)

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            with self._lock:
                sandboxes = list(self._sandboxes)
                if not sandboxes:
                    self._thread = None
                    return
            for sandbox in sandboxes:
                try:
                    sandbox.check_disk()
                except SandboxGone:
                    self.discard(sandbox)
                except Exception:  # noqa: BLE001 - one sandbox's failure must not stop the others' watch
                    log.exception("disk quota check of container %s failed", sandbox.sandbox_id[:12])
            del sandboxes


def _user_folders(user: str) -> bytes:
    """A tar of the folders a non-root user needs in a fresh container: the shell session's state
    and its home. Fixed times: every sandbox of a task starts alike."""
    uid, gid = (int(part) for part in user.split(":"))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, mode in ((STATE_DIR.lstrip("/"), 0o700), (_HOME.lstrip("/"), 0o755)):
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.uid, info.gid, info.mtime = tarfile.DIRTYPE, mode, uid, gid, 0
            tar.addfile(info)
    return buffer.getvalue()


def _container_labels(image: dict[str, Any], labels: Mapping[str, str]) -> dict[str, str]:
    # Containers inherit their image's labels and docker cannot remove one, so labels a snapshot
    # carried from its source sandbox are blanked: a fork carries exactly the labels it was given.
    inherited = image["Config"].get("Labels") or {}
    blanked = {key: "" for key in inherited if key not in (OWNER_LABEL, SHELL_LABEL)}
    return {**blanked, **labels, OWNER_LABEL: OWNER, KIND_LABEL: "sandbox"}


def _label_filter(kind: str, selector: Mapping[str, str] | None) -> list[str]:
    return [f"{OWNER_LABEL}={OWNER}", f"{KIND_LABEL}={kind}", *(f"{k}={v}" for k, v in (selector or {}).items())]


def _owned(resource_id: str, labels: Mapping[str, str] | None, created: int | None) -> OwnedResource:
    created_at = dt.datetime.fromtimestamp(created, dt.UTC) if created else None
    return OwnedResource(id=resource_id, labels={k: v for k, v in (labels or {}).items() if v}, created_at=created_at)
