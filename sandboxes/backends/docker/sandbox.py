"""A docker sandbox: one running container. Its calls run one at a time in the shell session
(session.py), each started by the container's session agent (agent.py) or, where that agent cannot
take it, by a `docker exec` of its own (both run it alike), observed from the container's layer on the host where it is in reach (overlay.py),
and a call that outlives its timeout is killed from the host (procs.py). Snapshots are commits
without pausing, with the exact file times the commit rounded written back."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import docker
import docker.errors

from ..base import (
    OWNER,
    OWNER_LABEL,
    SOURCE_LABEL,
    EngineUnavailable,
    EngineUnreachable,
    InvalidToolArgs,
    Sandbox,
    SandboxError,
    SandboxGone,
    SandboxOverQuota,
    SandboxTampered,
    SnapshotInfo,
    check_labels,
    require_str,
)
from ..hostfs import StateDigest
from ..overlay import (
    TICK_NS,
    LayerState,
    LayerTooLarge,
    LayerWatch,
    SessionTampered,
    restore_file_times,
    settle_after,
)
from ..procs import host_sees, kill_call_tree, sessions_below
from .agent import ProtocolError, SessionAgent, SessionBroken, SessionUnavailable
from .engine import ENGINE_DOWN, engine_errors
from .execstream import ExecStream, Output, Stop
from .images import KIND_LABEL, SHELL_LABEL, SNAPSHOT_REPOSITORY
from .quota import DiskQuota
from .session import CALL_SCRIPT, MAX_COMMAND_BYTES, SESSION_FILES, STATE_DIR, call_argv

if TYPE_CHECKING:
    from .backend import DockerBackend

log = logging.getLogger(__name__)

_KILL_GRACE_S = 5.0
_DEATH_SETTLE_S = 0.25
_SESSION_MAX_FAILURES = 3  # agents that failed a sandbox before its calls run by exec only
_SESSION_START_S = 5.0  # an agent that has not started a call this long after it was sent is given up
_SESSION_FIND_S = 1.0  # how long a timed-out call is looked for below its agent
_UNSET = object()


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
        self._last_start_ns: int | None = None  # when the last call started (its changes' times are kept)
        self._stopped = False
        self._agent: SessionAgent | None = None  # this process's session agent in the container (agent.py)
        self._agent_failures = 0 if backend.config.session else _SESSION_MAX_FAILURES
        self._quota = DiskQuota(backend.config)
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
            since = None if self._last_start_ns is None else self._last_start_ns - TICK_NS
            try:
                return watch.fingerprint(self._backend.base_layers(self.sandbox_id),
                                         max_bytes=self._backend.config.fingerprint_max_bytes, changed_since_ns=since)
            except SessionTampered as exc:
                raise SandboxTampered(str(exc)) from None
            except (LayerTooLarge, OSError):  # too large to fingerprint, or the container is going
                return None

    def restore_file_times(self, times: Mapping[str, int]) -> None:
        """After a replayed call: the times its live run left (overlay.LayerWatch.set_file_times)."""
        with self._lock:
            watch = self._layer_watch()
            if watch is None or not times:
                return
            self._layer = None
            try:
                watch.set_file_times(times)
            except OSError as exc:
                self._raise_if_gone()
                raise EngineUnavailable(f"could not restore file times: {exc}") from exc
            finally:  # the next call starts a tick after these changes (their ctimes are not its own)
                self._last_end_ns = time.time_ns()

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
        if "\x00" in command or len(command.encode("utf-8")) > MAX_COMMAND_BYTES:
            raise InvalidToolArgs(f"command must be at most {MAX_COMMAND_BYTES} bytes without NUL characters")
        return command, timeout_s

    def _layer_watch(self) -> LayerWatch | None:
        if self._watch is _UNSET:
            config = self._backend.config
            if not config.observe_writes:
                self._watch = None
                return None
            with engine_errors():
                container = self._gone_if_missing(self._backend.api.inspect_container, self.sandbox_id)
            self._watch = LayerWatch.of(container, session=(STATE_DIR.lstrip("/"), SESSION_FILES),
                                        max_entries=config.observe_max_entries)
        return self._watch

    def _timeout(self, args: Mapping[str, Any]) -> float:
        config = self._backend.config
        timeout_s = args.get("timeout_s", config.default_timeout_s)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise InvalidToolArgs('"timeout_s" must be a positive number', details={"field": "timeout_s"})
        return min(float(timeout_s), config.max_timeout_s)

    def _run(self, command: str, timeout_s: float) -> dict[str, Any]:
        self._raise_if_over_quota()
        settle_after(self._last_end_ns)  # calls (and replays) a file-time tick apart, as live ones are
        self._last_start_ns = time.time_ns()  # the settle put the previous writes a tick before it
        try:
            if self._agent_failures < _SESSION_MAX_FAILURES:
                try:
                    return self._run_in_session(command, timeout_s)
                except SessionUnavailable as exc:  # the call did not run: an exec runs it
                    self._agent_end()
                    self._agent_failed(str(exc))
            return self._run_exec(command, timeout_s)
        finally:
            self._last_end_ns = time.time_ns()

    def _run_exec(self, command: str, timeout_s: float) -> dict[str, Any]:
        config = self._backend.config
        api = self._backend.api
        deadline = time.monotonic() + timeout_s
        argv = call_argv(self._shell, command)
        try:
            exec_id = self._gone_if_missing(api.exec_create, self.sandbox_id, argv)["Id"]
        except ENGINE_DOWN as exc:  # nothing ran yet
            raise EngineUnreachable(f"docker engine unreachable: {exc}") from exc
        stream = ExecStream(self._gone_if_missing(api.exec_start, exec_id, socket=True))
        output = Output(config.output_cap_bytes)
        try:
            stop = stream.pump(output, deadline, config.output_kill_bytes)
            if stop is not Stop.EOF:
                self._kill_call(exec_id)
                stream.pump(output, time.monotonic() + _KILL_GRACE_S, float("inf"))
        except OSError as exc:  # the hijacked connection broke: engine or container went away
            self._raise_if_gone()
            raise EngineUnavailable(f"exec stream broke: {exc}") from exc
        finally:
            stream.close()
        return self._result(output, stop, self._exit_code(exec_id, time.monotonic() + _KILL_GRACE_S))

    def _result(self, output: Output, stop: Stop, exit_code: int | None) -> dict[str, Any]:
        if exit_code is None or exit_code >= 128:  # signalled: maybe by the container's death
            self._raise_if_gone()
        self.check_disk(after_call=True)
        return {
            "stdout": output.text(1),
            "stderr": output.text(2),
            "exit_code": exit_code,
            "timed_out": stop is Stop.DEADLINE,
            "truncated": output.truncated or stop is Stop.FLOOD,
        }

    # --- the session agent (agent.py) -----------------------------------------------------------

    def _agent_failed(self, why: str) -> None:
        log.info("container %s: its session agent failed (%s)", self.sandbox_id[:12], why)
        self._agent_failures += 1

    def _run_in_session(self, command: str, timeout_s: float) -> dict[str, Any]:
        """The call in the container's agent. SessionUnavailable when it did not run; SessionBroken
        when the agent died or left its protocol once it may have run."""
        config = self._backend.config
        deadline = time.monotonic() + timeout_s
        agent = self._agent_started()
        output = Output(config.output_cap_bytes)
        frames = agent.send(command, output)
        try:
            # A healthy agent starts the call at once; one that does not is never waited for long.
            started = self._pump(agent, frames, time.monotonic() + _SESSION_START_S, float("inf"),
                                 until=lambda: frames.started)
            if frames.unavailable:
                self._agent_failures = _SESSION_MAX_FAILURES
                raise SessionUnavailable("a tool the agent needs is gone")
            if not frames.started:
                self._agent_unstarted(agent, frames, started)
            stop = self._pump(agent, frames, deadline, config.output_kill_bytes)
            if stop is Stop.EOF:
                raise self._broken(frames, "the agent ended during the call")
            if stop is not Stop.DONE:  # the deadline or a flood: kill the call, then drain its output
                self._kill_agent_call(agent, frames)
                if self._pump(agent, frames, time.monotonic() + _KILL_GRACE_S, float("inf")) is not Stop.DONE:
                    # Its output is held open past the kill (a process that left its tree): the call
                    # ends here as an exec's stream would be closed, and the agent relaying it goes.
                    frames.flush()
                    self._agent_end()
                    if frames.exit_code is None:
                        raise self._broken(frames, "the call left no exit status")
            if frames.finished and not frames.relays_ok:
                raise self._broken(frames, "a relay of the call's output failed")
        except OSError as exc:  # the hijacked connection broke: engine or container went away
            self._agent_end()
            self._raise_if_gone()
            raise EngineUnavailable(f"the session's stream broke: {exc}") from exc
        return self._result(output, stop, frames.exit_code)

    def _agent_started(self) -> SessionAgent:
        if self._agent is None:
            if not self._host_sees():  # its calls could not be killed from the host
                self._agent_failures = _SESSION_MAX_FAILURES
                raise SessionUnavailable("the container's processes are out of this host's view")
            try:
                self._agent = self._gone_if_missing(SessionAgent.open, self._backend.api, self.sandbox_id, self._shell,
                                                    CALL_SCRIPT)
            except ENGINE_DOWN as exc:  # nothing ran yet
                raise EngineUnreachable(f"docker engine unreachable: {exc}") from exc
        return self._agent

    def _agent_unstarted(self, agent: SessionAgent, frames: Any, stop: Stop) -> None:
        """An agent that did not start the call in time is killed; its stream then tells whether it
        had started it after all (its start marker comes before the call's processes exist)."""
        if stop is Stop.DEADLINE:
            self._agent_kill(agent)
            stop = self._pump(agent, frames, time.monotonic() + _KILL_GRACE_S, float("inf"), until=lambda: frames.started)
        self._agent_end()
        if frames.started or stop is not Stop.EOF:
            self._raise_if_gone()
            raise SandboxError(f"container {self.sandbox_id[:12]}: its session agent was stuck; whether the call ran is unknown")
        raise SessionUnavailable("the agent ended before it started the call")

    def _pump(self, agent: SessionAgent, frames: Any, deadline: float, flood_bytes: float, until: Any = None) -> Stop:
        try:
            return agent.stream.pump(frames, deadline, flood_bytes, until)
        except ProtocolError as exc:
            raise self._broken(frames, f"the agent left its protocol: {exc}") from None

    def _broken(self, frames: Any, why: str) -> SandboxError:
        """The error for a call whose agent ended or broke once it may have run, after the agent was
        killed: SandboxGone if the container died, else SessionBroken."""
        self._agent_end()
        self._raise_if_gone()
        self._agent_failed(why)
        return SessionBroken(f"container {self.sandbox_id[:12]}: {why}; the call's effects are unknown")

    def _kill_agent_call(self, agent: SessionAgent, frames: Any) -> None:
        """Kills the call the agent runs, from the host: the session below the agent (procs.py). A
        call still starting is looked for a moment; one that ended meanwhile leaves nothing to kill.
        One never found (it left the agent's tree) dies with the agent's tree if it does not end."""
        grace = time.monotonic() + _SESSION_FIND_S
        while not frames.finished:
            pid = agent.pid()
            calls = sessions_below(pid, self.sandbox_id) if pid else []
            for call in calls:
                kill_call_tree(call, self.sandbox_id)
            if calls or time.monotonic() > grace:
                return
            if self._pump(agent, frames, time.monotonic() + 0.01, float("inf")) is Stop.EOF:
                return

    def _agent_end(self) -> None:
        """Closes this process's agent, its whole tree killed from the host first (a stuck or
        tampered agent never gets another call, and no process of it outlives it)."""
        agent, self._agent = self._agent, None
        if agent is not None:
            self._agent_kill(agent)
            agent.close()

    def _agent_kill(self, agent: SessionAgent) -> None:
        try:
            pid = agent.live_pid()
        except docker.errors.APIError:
            pid = 0
        if pid:
            kill_call_tree(pid, self.sandbox_id)

    def _host_sees(self) -> bool:
        init_pid = self._gone_if_missing(self._backend.api.inspect_container, self.sandbox_id)["State"].get("Pid") or 0
        return host_sees(self.sandbox_id, init_pid)

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
        agent, self._agent = self._agent, None
        if agent is not None:
            agent.close()
        if not self._stopped:
            self._backend.remove_sandbox(self.sandbox_id)
            self._stopped = True

    def alive(self) -> bool:
        with engine_errors():
            try:
                return bool(self._backend.api.inspect_container(self.sandbox_id)["State"]["Running"])
            except docker.errors.NotFound:
                return False
