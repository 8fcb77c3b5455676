"""A docker sandbox: one running container. Its calls run one at a time in the shell session
(session.py, kept by the host), each started by the container's session agent (agent.py) or, where
that agent cannot take it, by a `docker exec` of its own (both run it alike), observed from the
container's layer and the processes it keeps running, on the host where they are in reach
(overlay.py, procs.py), and a call that outlives its timeout is killed from the host (procs.py).
Snapshots are commits without pausing, with the exact file times the commit rounded written back
and the session in their labels."""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
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
    restore_file_times,
    settle_after,
)
from ..procs import (
    INSIDE_SCAN,
    LiveProcess,
    engine_processes,
    host_sees,
    inside_processes,
    kill_call_tree,
    live_processes,
    sessions_below,
)
from .agent import ExecFrames, ProtocolError, SessionAgent, SessionBroken, SessionUnavailable
from .checkpoint import CheckpointFailed, SandboxRuntime, checkpoint_commit, kill_calls_inside
from .confinement import KEEPALIVE
from .engine import ENGINE_DOWN, engine_errors
from .execstream import ExecStream, Output, Stop
from .images import CHECKPOINT_LABEL, KIND_LABEL, RUNTIME_LABEL, SHELL_LABEL, SNAPSHOT_REPOSITORY
from .quota import DiskQuota
from .session import (
    CALL_SCRIPT,
    MAX_COMMAND_BYTES,
    MAX_SESSION_BYTES,
    SESSION_LABEL,
    SessionRecord,
    exec_argv,
    initial_session,
    labelled_session,
    session_label,
    sessions,
)

if TYPE_CHECKING:
    from .backend import DockerBackend

log = logging.getLogger(__name__)

_KILL_GRACE_S = 5.0
_DEATH_SETTLE_S = 0.25
_SESSION_MAX_FAILURES = 3  # agents that failed a sandbox before its calls run by exec only
_SESSION_START_S = 5.0  # an agent that has not started a call this long after it was sent is given up
_SESSION_FIND_S = 1.0  # how long a timed-out call is looked for below its agent
_BUSY_WAIT_S = 0.5  # how long a fingerprint waits for a live process at work to settle
_BUSY_POLL_S = 0.01
_UNSET = object()


class DockerSandbox(Sandbox):
    def __init__(
        self,
        backend: DockerBackend,
        container_id: str,
        *,
        shell: str,
        image_size: int,
        runtime: SandboxRuntime = SandboxRuntime("runc", checkpoints=False),
    ):
        self.sandbox_id = container_id
        self._backend = backend
        self.runtime = runtime  # its snapshots are checkpoints where runtime.checkpoints (checkpoint.py)
        self._shell = shell
        self._image_size = image_size  # snapshots report only what the sandbox added to its image
        # One shell session: calls run one at a time, and a snapshot never lands mid-call.
        self._lock = threading.Lock()
        self._watch: LayerWatch | None | object = _UNSET
        self._base: frozenset[str] | None = None  # its base image's layers: a container's image never changes
        self._layer: LayerState | None = None  # the layer as the last observed call left it
        self._last_end_ns = 0  # when the last call ended: the next starts a file-time tick later
        self._last_start_ns: int | None = None  # when the last call started (its changes' times are kept)
        self._stopped = False
        self._session: bytes | None = None  # the shell session (session.py), as far as this process knows
        self._stamp: tuple[int, int] | None = None  # of the SessionStore's record this process read or wrote
        self._live: tuple[LiveProcess, ...] | None = None  # the processes it kept running after its last call
        self._drifted = False  # its state changed on its own before the last observed call
        self._init_pid = 0
        self._observed_ms = 0.0  # spent observing processes (observed_ms)
        self._agent: SessionAgent | None = None  # this process's session agent in the container (agent.py)
        self._agent_failures = 0 if backend.config.session else _SESSION_MAX_FAILURES
        self._quota = DiskQuota(backend.config)
        if self._quota.limit_bytes:
            backend.disk_watch.add(self)

    @property
    def keeps_processes(self) -> bool:
        return self.runtime.checkpoints

    def execute(self, tool: str, args: Mapping[str, Any]) -> dict[str, Any]:
        command, timeout_s = self._parse(tool, args)
        with self._lock, engine_errors():
            self._session_synced()
            self._layer, self._live = None, None  # not observed: the next observed call lists the state first
            try:
                return self._run(command, timeout_s)
            finally:
                self._session_keep()

    def execute_observed(self, tool: str, args: Mapping[str, Any]) -> tuple[dict[str, Any], bool | None]:
        """Observed from the container's layer and processes on the host (overlay.py, procs.py),
        when they are in reach. A state that had live processes after the last call is listed again
        before this one: if it changed meanwhile, it drifted (`state_drifted`)."""
        command, timeout_s = self._parse(tool, args)
        with self._lock:
            with engine_errors():
                self._session_synced()
            before, self._drifted = self._layer, False
            if before is None or self._live is None or self._live:
                started = time.perf_counter()
                now = self._layer_state()
                if before is not None:  # listed again only because processes ran meanwhile
                    self._observed_ms += (time.perf_counter() - started) * 1000
                self._drifted = before is not None and now is not None and now.digest != before.digest
                before = now
            self._layer = None  # unknown until the call is over
            if before is not None:
                LayerWatch.settle(before)
            try:
                with engine_errors():
                    result = self._run(command, timeout_s)
                if before is not None:
                    self._layer = self._layer_state(settle=True)
            finally:
                self._session_keep()
            if before is None:
                return result, None
            return result, None if self._layer is None else self._layer.digest != before.digest

    def state_drifted(self) -> bool:
        return self._drifted

    def observed_ms(self) -> float:
        return self._observed_ms

    def state_fingerprint(self) -> StateDigest | None:
        """With the shell session and the live processes. A state with live processes is listed
        again once fingerprinted: one that changed since the call's end is not settled, nor one
        with a process still at work (running or runnable) after _BUSY_WAIT_S, which is what a loop
        that writes looks like even when starved of CPU between the two looks."""
        with self._lock:
            watch = self._layer_watch()
            if watch is None:
                return None
            since = None if self._last_start_ns is None else self._last_start_ns - TICK_NS
            try:
                with engine_errors():
                    session = self._session_synced()
                    live = self._settled_processes()
                if live is None:  # processes out of view: a state is not vouched for without them
                    return None
                digest = watch.fingerprint(
                    self._base_layers(),
                    max_bytes=self._backend.config.fingerprint_max_bytes,
                    changed_since_ns=since,
                    max_changed=self._backend.config.file_times_max,
                    session=session,
                    processes=tuple(p.line() for p in live),
                )
                if live and self._layer is not None:
                    started = time.perf_counter()
                    now = watch.state(self._extra(session, live))
                    self._observed_ms += (time.perf_counter() - started) * 1000
                    if now.digest != self._layer.digest or any(p.runnable for p in live):
                        digest = dataclasses.replace(digest, settled=False)
                return digest
            except (LayerTooLarge, OSError):  # too large to fingerprint, or the container is going
                return None

    def restore_file_times(self, times: Mapping[str, int]) -> None:
        """After a replayed call: the times its live run left (overlay.LayerWatch.set_file_times)."""
        with self._lock:
            watch = self._layer_watch()
            if watch is None or not times:
                return
            self._layer = None
            self._session_keep()
            try:
                watch.set_file_times(times)
            except OSError as exc:
                self._raise_if_gone()
                raise EngineUnavailable(f"could not restore file times: {exc}") from exc
            finally:  # the next call starts a tick after these changes (their ctimes are not its own)
                self._last_end_ns = time.time_ns()

    def _layer_state(self, *, settle: bool = False) -> LayerState | None:
        """The layer, the session and the live processes as they are now (`_live` set to those);
        None when they are not observed: out of reach, gone (the container is being removed), or
        too large to list per call (then never again). With `settle` (after a call), processes at
        work are given time to settle first: one the call left exiting would otherwise be seen
        alive or not by chance, and the call taken for a change of state."""
        watch = self._layer_watch()
        if watch is None:
            return None
        try:
            with engine_errors():
                self._live = self._settled_processes() if settle else self._processes()
            if self._live is None:
                return None
            return watch.state(self._extra(self._session or b"", self._live))
        except LayerTooLarge:
            self._watch = None
        except OSError:
            pass
        return None

    @staticmethod
    def _extra(session: bytes, live: tuple[LiveProcess, ...]) -> bytes:
        """What a layer's listing is compared with besides its files."""
        return b"session\0" + session + b"\0processes\0" + b"\n".join(sorted(p.line() for p in live))

    # --- the processes it keeps running (procs.py) ----------------------------------------------

    def _settled_processes(self) -> tuple[LiveProcess, ...] | None:
        """The live processes, once none is at work or after _BUSY_WAIT_S: a daemon still starting
        or a process exiting settles; a loop at work does not."""
        live = self._processes()
        deadline = time.monotonic() + _BUSY_WAIT_S
        while live and any(p.runnable for p in live) and time.monotonic() < deadline:
            time.sleep(_BUSY_POLL_S)
            live = self._processes()
        return live

    def _processes(self) -> tuple[LiveProcess, ...] | None:
        started = time.perf_counter()
        try:
            return self._processes_now()
        finally:
            self._observed_ms += (time.perf_counter() - started) * 1000

    def _processes_now(self) -> tuple[LiveProcess, ...] | None:
        """The sandbox's own live processes: from the host's /proc where it sees them, else as the
        engine lists them (`docker top`), or under a runtime with its own kernel as its own /proc
        does (procs.INSIDE_SCAN); None where none can tell."""
        if not self.runtime.host_sees_processes:
            try:
                exec_id = self._gone_if_missing(
                    self._backend.api.exec_create, self.sandbox_id, [self._shell, "-c", INSIDE_SCAN]
                )["Id"]
                out, _ = self._backend.api.exec_start(exec_id, demux=True)
            except (SandboxError, docker.errors.APIError):
                return None
            return inside_processes(out or b"", tuple(KEEPALIVE))
        if self.runtime.host_sees_processes:
            for _ in range(2):  # the container's init changes when it is restored from a checkpoint
                if not self._init_pid:
                    self._init_pid = (
                        self._gone_if_missing(self._backend.api.inspect_container, self.sandbox_id)["State"].get("Pid")
                        or 0
                    )
                found = live_processes(self.sandbox_id, self._init_pid, tuple(KEEPALIVE)) if self._init_pid else None
                if found is not None:
                    return found
                self._init_pid = 0
        try:
            top = self._gone_if_missing(self._backend.api.top, self.sandbox_id)
        except SandboxError:
            return None
        return engine_processes(top, self._init_pid, tuple(KEEPALIVE))

    # --- the shell session (session.py) ---------------------------------------------------------

    def _session_synced(self) -> bytes:
        """The session (and the state the last call left) as whichever process ran the last call
        kept it: this one's, or the SessionStore's when another wrote it since; a container no call
        of this host's service has run in starts from its image's (a fork's snapshot carries it)."""
        store = sessions()
        stamp = store.stamp(self.sandbox_id)
        if self._session is not None and (stamp is None or self._stamp is None or stamp == self._stamp):
            return self._session
        found = store.get(self.sandbox_id) if stamp is not None else None
        if found is not None:
            record, self._stamp = found
            self._session = record.session
            self._layer = LayerState(record.layer, record.newest_ns) if record.layer is not None else None
            self._live = () if record.layer is not None and not record.live else None
            return self._session
        self._session, self._layer, self._live = self._image_session(), None, None
        self._session_keep()
        return self._session

    def _image_session(self) -> bytes:
        container = self._gone_if_missing(self._backend.api.inspect_container, self.sandbox_id)
        image = self._backend.api.inspect_image(container["Image"])
        found = labelled_session(image["Config"].get("Labels"))
        if found is None:
            found = self._gone_if_missing(initial_session, self._backend.api, self.sandbox_id)[1]
        return found

    def _session_keep(self) -> None:
        """After a call: the session, and the state the call left, for the next call of whichever
        process (a store that cannot write leaves this process's own copy the one it trusts)."""
        if self._session is None:
            return
        layer, live = self._layer, self._live
        record = SessionRecord(
            self._session,
            layer.digest if layer else None,
            layer.newest_ns if layer else 0,
            len(live) if live is not None else 0,
        )
        self._stamp = sessions().put(self.sandbox_id, record)

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
            self._watch = LayerWatch.of(container, max_entries=config.observe_max_entries)
        return self._watch

    def _base_layers(self) -> frozenset[str]:
        if self._base is None:
            self._base = self._backend.base_layers(self.sandbox_id)
        return self._base

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
        nonce = secrets.token_hex(16)
        argv = exec_argv(self._shell, nonce, command, self._session or b"")
        try:
            exec_id = self._gone_if_missing(api.exec_create, self.sandbox_id, argv)["Id"]
        except ENGINE_DOWN as exc:  # nothing ran yet
            raise EngineUnreachable(f"docker engine unreachable: {exc}") from exc
        stream = ExecStream(self._gone_if_missing(api.exec_start, exec_id, socket=True))
        output = Output(config.output_cap_bytes)
        frames = ExecFrames(output, nonce)
        try:
            stop = stream.pump(frames, deadline, config.output_kill_bytes)
            if stop is not Stop.EOF:
                self._kill_call(exec_id)
                stream.pump(frames, time.monotonic() + _KILL_GRACE_S, float("inf"))
        except OSError as exc:  # the hijacked connection broke: engine or container went away
            self._raise_if_gone()
            raise EngineUnavailable(f"exec stream broke: {exc}") from exc
        finally:
            stream.close()
            frames.end()
        if frames.session is not None and len(frames.session) <= MAX_SESSION_BYTES:
            self._session = frames.session
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
        sent = self._session or b""
        frames = agent.send(command, output, sent)
        try:
            # A healthy agent starts the call at once; one that does not is never waited for long.
            started = self._pump(
                agent, frames, time.monotonic() + _SESSION_START_S, float("inf"), until=lambda: frames.started
            )
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
        if frames.session_done:  # the agent now holds the session it was handed back, else the one it was sent
            handed = frames.session
            if handed is not None and len(handed) <= MAX_SESSION_BYTES:
                self._session = handed
            agent.holds = handed if handed is not None else (None if frames.session_dropped else sent)
        return self._result(output, stop, frames.exit_code)

    def _agent_started(self) -> SessionAgent:
        if self._agent is None:
            if not self._host_sees():  # its calls could not be killed from the host
                self._agent_failures = _SESSION_MAX_FAILURES
                raise SessionUnavailable("the container's processes are out of this host's view")
            try:
                self._agent = self._gone_if_missing(
                    SessionAgent.open, self._backend.api, self.sandbox_id, self._shell, CALL_SCRIPT
                )
            except ENGINE_DOWN as exc:  # nothing ran yet
                raise EngineUnreachable(f"docker engine unreachable: {exc}") from exc
        return self._agent

    def _agent_unstarted(self, agent: SessionAgent, frames: Any, stop: Stop) -> None:
        """An agent that did not start the call in time is killed; its stream then tells whether it
        had started it after all (its start marker comes before the call's processes exist)."""
        if stop is Stop.DEADLINE:
            self._agent_kill(agent)
            stop = self._pump(
                agent, frames, time.monotonic() + _KILL_GRACE_S, float("inf"), until=lambda: frames.started
            )
        self._agent_end()
        if frames.started or stop is not Stop.EOF:
            self._raise_if_gone()
            raise SandboxError(
                f"container {self.sandbox_id[:12]}: its session agent was stuck; whether the call ran is unknown"
            )
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
        if not self.runtime.host_sees_processes:
            self._kill_inside(agent=False)
            return
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
        if not self.runtime.host_sees_processes:
            self._kill_inside(agent=True)
            return
        try:
            pid = agent.live_pid()
        except docker.errors.APIError:
            pid = 0
        if pid:
            kill_call_tree(pid, self.sandbox_id)

    def _kill_inside(self, *, agent: bool) -> None:
        """A runtime with a kernel of its own (gVisor): the call is killed from the sandbox's own
        process table (checkpoint.kill_calls_inside); where that fails, the container is killed."""
        try:
            self._gone_if_missing(kill_calls_inside, self._backend.api, self.sandbox_id, self._shell, agent=agent)
        except SandboxGone:
            raise
        except (SandboxError, docker.errors.APIError) as exc:
            log.warning(
                "container %s: its call could not be killed inside (%s); killing the container",
                self.sandbox_id[:12],
                exc,
            )
            self._gone_if_missing(self._backend.api.kill, self.sandbox_id)

    def _host_sees(self) -> bool:
        init_pid = self._gone_if_missing(self._backend.api.inspect_container, self.sandbox_id)["State"].get("Pid") or 0
        return host_sees(self.sandbox_id, init_pid)

    def _kill_call(self, exec_id: str) -> None:
        """Kills the call's session and process tree from the host (procs.py). Where the engine's
        processes are out of this host's view (a remote engine), the container is killed instead:
        nothing inside it is trusted to do the killing."""
        api = self._backend.api
        if not self.runtime.host_sees_processes:
            self._kill_inside(agent=False)
            return
        init_pid = self._gone_if_missing(api.inspect_container, self.sandbox_id)["State"].get("Pid") or 0
        if host_sees(self.sandbox_id, init_pid):
            pid = self._exec_pid(exec_id, time.monotonic() + _KILL_GRACE_S)
            if pid:
                kill_call_tree(pid, self.sandbox_id)
            return
        log.warning(
            "container %s: its processes are out of this host's view; killing the container to end a call",
            self.sandbox_id[:12],
        )
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
        sessions().drop(self.sandbox_id)
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
            snapshot_labels[SESSION_LABEL] = session_label(self._session_synced())  # a fork resumes it
            started = time.perf_counter()
            checkpoint = self.runtime.checkpoints and self._backend.checkpoint_store().reachable(self.sandbox_id)
            if checkpoint:
                kept = self._checkpoint(
                    ref, {**snapshot_labels, CHECKPOINT_LABEL: tag, RUNTIME_LABEL: self.runtime.name}
                )
            else:
                kept = 0
                # pause=False: the sandbox keeps running; calls are held off by the lock instead.
                self._gone_if_missing(
                    self._backend.api.commit,
                    self.sandbox_id,
                    repository=repository,
                    tag=tag,
                    pause=False,
                    conf={"Labels": snapshot_labels},
                )
            image = self._backend.api.inspect_image(ref)
            self._restore_file_times(image)
            create_ms = (time.perf_counter() - started) * 1000
            size = image["Size"]
        return SnapshotInfo(
            ref=ref, size_bytes=max(size - self._image_size, 0) + kept, create_ms=create_ms, keeps_processes=checkpoint
        )

    def _checkpoint(self, ref: str, labels: Mapping[str, str]) -> int:
        """A checkpoint snapshot (checkpoint.py); the sandbox goes on restored from it. Its session
        agent ends first, so that no fork carries one. A sandbox that could not be restored is gone."""
        agent = self._agent
        self._agent_end()
        if agent is not None:
            self._agent_exited(agent)
        # The engine rewrites its own files (hosts, hostname, resolv.conf) when it restores a
        # container: the state the next call is compared with is taken again after the restore,
        # unless it had changed since the last call already (that stays a drift).
        settled = self._layer is not None and getattr(self._layer_state(), "digest", None) == self._layer.digest
        try:
            kept = self._gone_if_missing(
                checkpoint_commit, self._backend.api, self._backend.checkpoint_store(), self.sandbox_id, ref, labels
            )
        except CheckpointFailed as exc:
            if not self.alive():
                raise SandboxGone(exc.message) from None
            raise
        if settled:
            self._layer = self._layer_state()
            self._session_keep()
        return kept

    def _agent_exited(self, agent: SessionAgent) -> None:
        """Until the closed agent's shell has read its end of input and exited (a moment)."""
        deadline = time.monotonic() + _KILL_GRACE_S
        while time.monotonic() < deadline:
            try:
                if not self._backend.api.exec_inspect(agent.exec_id).get("Running"):
                    return
            except docker.errors.APIError:
                return
            time.sleep(0.01)

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
        sessions().drop(self.sandbox_id)

    def alive(self) -> bool:
        with engine_errors():
            try:
                return bool(self._backend.api.inspect_container(self.sandbox_id)["State"]["Running"])
            except docker.errors.NotFound:
                return False
