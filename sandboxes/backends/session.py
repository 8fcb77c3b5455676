"""A docker sandbox's shell session: one agent process per container that runs each call, spoken to
over the stdin and output of its own `docker exec`.

A `docker exec` costs 50 to 90 ms here before its command runs (two engine requests, a process
spawned by the runtime). The session pays that once per container and process: each call is then
one write on the exec's stdin and its output read back from the same stream, about a millisecond
on top of the call's own shell.

The agent is a shell script (ash on busybox, bash on debian: no python needed), so it adds no file
to the sandbox. Each call runs exactly as a `docker exec` of `_CALL_SCRIPT` does: a fresh shell
under `env -i` that restores the cwd and exports from /.tvcache and saves them on exit, in a
session of its own (`setsid`), stdin from /dev/null. Its stdout and stderr are relayed by one
`cat` each to the agent's own stdout and stderr, so a call ends when every process holding its
output has closed it, as an exec's stream does.

The protocol, per call (the host writes, the agent answers on its stderr and stdout):
- request: a line of a random nonce and the command's line count, then the command's lines;
- `\\0TVC<nonce> start\\n` on stderr before the call's processes exist (before it, a dead agent
  means the call never ran: it can run elsewhere), or `... unavailable` when a tool the agent
  needs is gone (the session ends);
- `\\0TVC<nonce> <exit code>\\n` last on stdout and `\\0TVC<nonce>\\n` last on stderr once both
  relays ended (docker forwards the two streams independently: each carries its own end).

Nothing the agent or the call prints is trusted: every read has a deadline, the markers carry a
nonce the call never sees, anything out of protocol ends the session, and the host kills a call
through its process tree (procs.py), never by asking the agent.
"""

from __future__ import annotations

import enum
import re
import secrets
import select
import socket
import struct
import time
import weakref
from collections.abc import Callable
from typing import Any

from .base import SandboxTampered

# Run as `SHELL -c AGENT_SCRIPT tvcache-session SHELL CALL_SCRIPT`; pipefail gives a pipeline the
# call's exit code, not the relay's (ash and bash have it; dash would not, so it runs under SHELL).
AGENT_SCRIPT = r"""set -o pipefail || exit 97
LC_ALL=C
__tvc_sh=$1 __tvc_call=$2
while IFS=' ' read -r __tvc_n __tvc_k; do
IFS= read -r __tvc_c || exit 96
while [ "$__tvc_k" -gt 1 ]; do
IFS= read -r __tvc_l || exit 96
__tvc_c="$__tvc_c
$__tvc_l" __tvc_k=$((__tvc_k - 1))
done
if ! { command -v cat && command -v setsid && command -v env; } >/dev/null 2>&1; then
printf '\0TVC%s unavailable\n' "$__tvc_n" >&2; exit 98
fi
printf '\0TVC%s start\n' "$__tvc_n" >&2
{ setsid env -i "$__tvc_sh" -c "$__tvc_call" "$__tvc_sh" "$__tvc_c" </dev/null 2>&1 >&3 3>&- | cat >&2; } 3>&1 </dev/null | cat
__tvc_r=$?
printf '\0TVC%s %s\n' "$__tvc_n" "$__tvc_r"
printf '\0TVC%s\n' "$__tvc_n" >&2
done
"""
AGENT_NAME = "tvcache-session"
_NONCE_BYTES = 16
_MARK = b"\0TVC"
_TAIL = len(_MARK) + 2 * _NONCE_BYTES + 1 + 3 + 1  # the longest end marker
_WRITE_S = 5.0  # a healthy agent reads its stdin at once; a request it does not take in this long ends it


class Stop(enum.Enum):
    EOF = "eof"
    DEADLINE = "deadline"
    FLOOD = "flood"
    DONE = "done"  # the sink saw the call's end (a session's markers)


class Output:
    """stdout/stderr of one call, each kept up to `cap` bytes."""

    finished = False

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


class ExecStream:
    """Reads docker's multiplexed exec stream: frames of 8-byte header (stream, 0, 0, 0, size) + data."""

    def __init__(self, sock: Any):
        self._sock = sock
        self._recv = getattr(sock, "recv", None) or sock.read
        self._buffer = bytearray(_read_ahead(sock))

    def pump(self, sink: Any, deadline: float, flood_bytes: float, until: Callable[[], bool] | None = None) -> Stop:
        """Frames into `sink` (`add(stream, data)`, `received`, `finished`) until the stream ends,
        the sink has the call's end (or `until()` holds), the deadline passes or more than
        `flood_bytes` came."""
        self._drain(sink)  # frames read ahead with the response headers
        while True:
            if sink.finished or (until is not None and until()):
                return Stop.DONE
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Stop.DEADLINE
            # TLS sockets may hold decrypted bytes that select() cannot see.
            pending = getattr(self._sock, "pending", lambda: 0)()
            if not pending and not select.select([self._sock], [], [], remaining)[0]:
                return Stop.DEADLINE
            data = self._recv(65536)
            if not data:
                return Stop.EOF
            self._buffer += data
            self._drain(sink)
            if sink.received > flood_bytes:
                return Stop.FLOOD

    def pending(self) -> bool:
        """Whether anything (data or the end) waits to be read, without blocking."""
        return bool(self._buffer) or bool(select.select([self._sock], [], [], 0)[0])

    def _drain(self, sink: Any) -> None:
        offset = 0
        while len(self._buffer) - offset >= 8:
            stream, size = struct.unpack_from(">BxxxL", self._buffer, offset)
            if len(self._buffer) - offset - 8 < size:
                break
            sink.add(stream, bytes(self._buffer[offset + 8 : offset + 8 + size]))
            offset += 8 + size
        del self._buffer[:offset]

    def close(self) -> None:
        # Closing the HTTP response closes the socket under it; closing the socket first breaks it.
        response = getattr(self._sock, "_response", None)
        (response or self._sock).close()


class SessionUnavailable(Exception):
    """The session could not take the call, which did not run: it can run in an exec instead."""


class SessionBroken(SandboxTampered):
    """The session died or left its protocol while a call ran: the call's effects are unknown."""

    code = "session_broken"


class ProtocolError(Exception):
    """The agent's stream carried something the protocol does not allow."""


class CallFrames:
    """One call's frames as a session sink: its output without the agent's markers, its start,
    and its end (both streams' end markers, the exit code). The last bytes of each stream are held
    back until it is clear they are not the start of an end marker."""

    def __init__(self, output: Output, nonce: str):
        self.output = output
        self.nonce = nonce.encode()
        self._start = _MARK + self.nonce + b" start\n"
        self._unavailable = _MARK + self.nonce + b" unavailable\n"
        self._end_err = _MARK + self.nonce + b"\n"
        self._end_out = re.compile(re.escape(_MARK + self.nonce) + rb" (\d{1,3})\n\Z")
        self._held = {1: b"", 2: b""}
        self._ended = {1: False, 2: False}
        self._opened = False  # stderr's start marker was read
        self.started = False
        self.unavailable = False
        self.exit_code: int | None = None

    @property
    def received(self) -> int:
        return self.output.received

    @property
    def finished(self) -> bool:
        return self.unavailable or (self._ended[1] and self._ended[2])

    def add(self, stream: int, data: bytes) -> None:
        if stream not in (1, 2) or self._ended[stream] or self.unavailable:
            raise ProtocolError(f"output on stream {stream} after the call's end")
        held = self._held[stream] + data
        if stream == 2 and not self._opened:
            held = self._take_start(held)
            if held is None:
                return
        if stream == 1 and held:
            self.started = True  # the agent prints its start before anything of the call's
        end = self._end(stream, held)
        if end is not None:
            self.output.add(stream, held[:end])
            self._held[stream], self._ended[stream] = b"", True
            return
        self.output.add(stream, held[:-_TAIL] if len(held) > _TAIL else b"")
        self._held[stream] = held[-_TAIL:]

    def flush(self) -> None:
        """Keeps what was held back: the call ends without its markers (the session is given up)."""
        for stream, held in self._held.items():
            self.output.add(stream, held)
            self._held[stream] = b""

    def _take_start(self, held: bytes) -> bytes | None:
        for marker in (self._start, self._unavailable):
            if held.startswith(marker):
                self._opened = True
                self.unavailable = marker is self._unavailable
                if self.unavailable and self.started:
                    raise ProtocolError("the call's output came before the agent refused it")
                self.started = self.started or not self.unavailable
                return held[len(marker):]
            if marker.startswith(held):
                self._held[2] = held
                return None
        raise ProtocolError("stderr did not open with the call's start")

    def _end(self, stream: int, held: bytes) -> int | None:
        if stream == 2:
            return len(held) - len(self._end_err) if held.endswith(self._end_err) else None
        match = self._end_out.search(held, max(0, len(held) - _TAIL))
        if match is None:
            return None
        self.exit_code = int(match.group(1))
        return match.start()


def new_nonce() -> str:
    return secrets.token_hex(_NONCE_BYTES)


def encode_request(nonce: str, command: str) -> bytes:
    """The nonce and the command's line count, then its lines (read back by the agent's `read`)."""
    body = command.encode("utf-8")
    lines = body.count(b"\n") + 1
    return f"{nonce} {lines}\n".encode() + body + b"\n"


class ShellSession:
    """The agent of one container, as this process started it; used under the sandbox's lock."""

    def __init__(self, api: Any, container_id: str, exec_id: str, sock: Any):
        self.api, self.container_id, self.exec_id = api, container_id, exec_id
        self.stream = ExecStream(sock)
        self._raw = getattr(sock, "_sock", sock)
        self._agent_pid = 0
        self.closed = False
        # A handle dropped without stop(): its agent reads the end of its stdin and exits.
        self._finalizer = weakref.finalize(self, _hang_up, self._raw, self.stream)

    @classmethod
    def open(cls, api: Any, container_id: str, shell: str, call_script: str) -> ShellSession:
        """Starts the agent (one exec); raises the engine's errors as the caller's exec would."""
        argv = [shell, "-c", AGENT_SCRIPT, AGENT_NAME, shell, call_script]
        exec_id = api.exec_create(container_id, argv, stdin=True)["Id"]
        sock = api.exec_start(exec_id, socket=True)
        return cls(api, container_id, exec_id, sock)

    def send(self, command: str, output: Output) -> CallFrames:
        """Hands the call to the agent. SessionUnavailable: the agent is gone or out of step (the
        call did not run)."""
        if self.closed:
            raise SessionUnavailable("the session is closed")
        if self.stream.pending():  # between calls nothing may come: the end, or output out of protocol
            raise SessionUnavailable("the agent ended or wrote between calls")
        frames = CallFrames(output, new_nonce())
        request = encode_request(frames.nonce.decode(), command)
        timeout = self._raw.gettimeout()
        try:
            self._raw.settimeout(_WRITE_S)
            self._raw.sendall(request)
        except OSError as exc:  # socket.timeout included: an agent that stopped reading
            raise SessionUnavailable(f"the agent did not take the call: {exc}") from exc
        finally:
            try:
                self._raw.settimeout(timeout)
            except OSError:
                pass
        return frames

    def agent_pid(self) -> int:
        """The agent's host pid (0 until the engine reports it)."""
        if not self._agent_pid:
            self._agent_pid = self.api.exec_inspect(self.exec_id).get("Pid") or 0
        return self._agent_pid

    def close(self) -> None:
        """Ends the agent: its stdin closes and its loop ends (the caller kills it if it must)."""
        self.closed = True
        self._finalizer()


def _hang_up(raw: Any, stream: ExecStream) -> None:
    try:
        raw.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    try:
        stream.close()
    except OSError:
        pass
