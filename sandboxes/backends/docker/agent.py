"""A container's session agent: one shell process started by a single `docker exec` with stdin
attached, that runs each bash call as a `docker exec` of session.CALL_SCRIPT would, so a call
costs its own shell's time instead of an exec's 50 to 90 ms.

The agent is a shell script (ash on busybox, bash on debian: nothing is added to the sandbox's
files). Per call it starts `setsid env -i SHELL -c CALL_SCRIPT SHELL COMMAND SESSION... </dev/null`:
a fresh shell from an empty environment, in a session of its own, with only fds 0, 1 and 2. The call's
stdout and stderr are pipes to two `cat` relays, which copy them to the agent's own stdout and
stderr; a relay ends when every process holding its pipe closed it, so the call ends when all its
output writers have closed, as an exec's stream does.

The protocol, per call; every marker carries a random nonce the call never sees:
- the host writes the nonce on a line, then the command and a NUL (commands hold none), then either
  `.` on a line (the call resumes the session the agent holds: the one it last ran or was handed
  back) or the number of the session's chunks on a line and each chunk followed by a NUL
  (session.py: the session travels as arguments of the call's shell);
- stderr opens with `\\0TVC<nonce> start` before the call's processes exist (an agent that dies
  before it ran nothing: the call can run by exec), or `... unavailable` when a tool the agent
  needs is gone (the agent exits);
- stdout carries `\\0TVC<nonce> c<status>` once the call's shell has exited (anywhere among the
  call's stdout: it does not wait for the relays), then, once both relays ended, `\\0TVC<nonce> s`
  and the session the call's shell handed back (none: it did not; it holds no NUL), then, last,
  `\\0TVC<nonce> end <relay statuses>`; stderr ends with `\\0TVC<nonce> end`.

Nothing in the agent is trusted to decide a result: a relay that did not end with status 0, a
missing exit status, a marker out of place, anything after a stream's end are out of protocol,
and the host kills a call from its process tree (procs.py), never by asking the agent.
"""

from __future__ import annotations

import re
import secrets
import socket
import weakref
from typing import Any

from ..base import SandboxTampered
from .execstream import ExecStream, Output
from .session import session_chunks

AGENT_NAME = "tvcache-session"
# Run as `SHELL -c AGENT_SCRIPT tvcache-session SHELL CALL_SCRIPT`. Fds: 5 and 6 keep the exec's
# stdout and stderr, and only markers and the relays write there: the agent's shells have their
# own stdout and stderr on /dev/null, so none of their messages (a shell reports a child killed by
# a signal: "Killed") can enter a call's output. The call's redirections are made by a subshell
# that becomes the call (exec), never by the shell that waits for it: ash applies a command's
# redirections in the waiting shell, which would print "Killed" into the call's stderr. 3 is the
# stdout relay's pipe, 4 the command substitution that collects the relays' statuses, 7 the one
# that collects the session the call's shell hands back (its parent's fd 7: session.py); the call
# has none of them, and stdin from /dev/null, as the groups around it have (the agent's stdin is
# the protocol's alone). The relays' statuses follow the session in fd 7's collection, after the
# nonce, which the call cannot write.
AGENT_SCRIPT = r"""exec 5>&1 6>&2 >/dev/null 2>&1
__tvc_sh=$1 __tvc_call=$2
set --
while IFS= read -r __tvc_n; do
IFS= read -r -d '' __tvc_c || exit 96
IFS= read -r __tvc_k || exit 96
case $__tvc_k in
.) ;;
''|*[!0-9]*) exit 96 ;;
*) set --; while [ "$__tvc_k" -gt 0 ]; do IFS= read -r -d '' __tvc_x || exit 96; set -- "$@" "$__tvc_x"
__tvc_k=$((__tvc_k - 1)); done ;;
esac
for __tvc_t in setsid env cat; do
command -v "$__tvc_t" || { printf '\0TVC%s unavailable\n' "$__tvc_n" >&6; exit 98; }
done
printf '\0TVC%s start\n' "$__tvc_n" >&6
__tvc_s=$( { __tvc_r=$( { { { (exec setsid env -i "$__tvc_sh" -c "$__tvc_call" "$__tvc_sh" "$__tvc_c" "$@" </dev/null 2>&1 >&3 3>&- 4>&- 5>&- 6>&- 7>&-)
printf '\0TVC%s c%s\n' "$__tvc_n" "$?" >&5; } 4>&- | { cat >&6; printf 'e%s ' "$?" >&4; } 3>&- 7>&-
} 3>&1 | { cat >&5; printf 'o%s ' "$?" >&4; } 7>&-; } 4>&1 </dev/null 2>/dev/null )
printf '%s%s' "$__tvc_n" "$__tvc_r"; } 7>&1 )
__tvc_r=${__tvc_s##*"$__tvc_n"} __tvc_s=${__tvc_s%"$__tvc_n"*}
[ -z "$__tvc_s" ] || set -- "$__tvc_s"
printf '\0TVC%s s\n%s\0TVC%s end %s\n' "$__tvc_n" "$__tvc_s" "$__tvc_n" "$__tvc_r" >&5
printf '\0TVC%s end\n' "$__tvc_n" >&6
done
"""
_NONCE_BYTES = 16
_MARK = b"\0TVC"
_MARKER_MAX = 64  # bytes after a marker's nonce, up to its newline
_STATUS = re.compile(rb" c(\d{1,3})")
_SESSION_MAX_BYTES = 1 << 20  # session.MAX_SESSION_BYTES: a larger one is dropped (the session stays)
_RELAYS = re.compile(rb" end (?:e0 o0|o0 e0) ")
_WRITE_S = 5.0  # a healthy agent reads its stdin at once; one that takes no request this long is given up


class SessionUnavailable(Exception):
    """The agent could not take the call, which did not run: an exec runs it instead."""


class SessionBroken(SandboxTampered):
    """The agent died or left its protocol after the call started: the call's effects are unknown.
    A healthy agent never does; a call that kills it or its relays does (the sandbox is retired)."""

    code = "session_broken"


class ProtocolError(Exception):
    """The agent's stream carried something the protocol does not allow."""


class CallFrames:
    """One call's frames as ExecStream's sink: the call's output without the agent's markers, its
    start, its exit status and both streams' ends. Docker forwards stdout and stderr apart, so
    stdout may come before stderr's start marker; stderr may not."""

    def __init__(self, output: Output, nonce: str):
        self.output = output
        self.prefix = _MARK + nonce.encode()
        self._pending = {1: bytearray(), 2: bytearray()}
        self._ended = {1: False, 2: False}
        self.started = False  # stderr opened with the start marker
        self.unavailable = False
        self.exit_code: int | None = None
        self.relays_ok = False
        self._session: bytearray | None = None  # after the ` s` marker: the session handed back
        self._session_over = False
        self.session_done = False

    @property
    def received(self) -> int:
        return self.output.received

    @property
    def finished(self) -> bool:
        return self.unavailable or (self._ended[1] and self._ended[2])

    def add(self, stream: int, data: bytes) -> None:
        if stream not in (1, 2) or self._ended[stream] or self.unavailable:
            raise ProtocolError(f"data on stream {stream} after the call's end")
        pending = self._pending[stream]
        pending += data
        if (
            stream == 2
            and not self.started
            and not (pending.startswith(self.prefix) or self.prefix.startswith(pending))
        ):
            raise ProtocolError("stderr did not open with the call's start")
        while pending:
            if self._ended[stream]:
                raise ProtocolError(f"data on stream {stream} after the call's end")
            at = pending.find(self.prefix)
            if at < 0:  # the last bytes may begin a marker: held until the next frame tells
                self._emit(stream, pending, max(len(pending) - len(self.prefix) + 1, 0))
                return
            self._emit(stream, pending, at)
            newline = pending.find(b"\n")
            if newline < 0:
                if len(pending) > len(self.prefix) + _MARKER_MAX:
                    raise ProtocolError("a marker without its end")
                return
            self._marker(stream, bytes(pending[len(self.prefix) : newline]))
            del pending[: newline + 1]

    @property
    def session_dropped(self) -> bool:
        """The call's shell handed back a session too large to keep."""
        return self._session_over

    @property
    def session(self) -> bytes | None:
        """The session the call's shell handed back; None: it did not (or it was too large)."""
        if not self.session_done or not self._session or self._session_over:
            return None
        return bytes(self._session)

    def _emit(self, stream: int, pending: bytearray, size: int) -> None:
        if not size:
            return
        if stream == 2 and not self.started:
            raise ProtocolError("stderr did not open with the call's start")
        if stream == 1 and self._session is not None:
            if len(self._session) + size > _SESSION_MAX_BYTES:
                self._session_over = True
            else:
                self._session += pending[:size]
        else:
            self.output.add(stream, bytes(pending[:size]))
        del pending[:size]

    def _marker(self, stream: int, body: bytes) -> None:
        if stream == 2:
            if not self.started and body in (b" start", b" unavailable"):
                self.started, self.unavailable = body == b" start", body == b" unavailable"
            elif self.started and body == b" end":
                self._ended[2] = True
            else:
                raise ProtocolError("an unexpected marker on stderr")
            return
        status = _STATUS.fullmatch(body)
        if status is not None and self.exit_code is None:
            self.exit_code = int(status.group(1))
        elif body == b" s" and self.exit_code is not None and self._session is None:
            self._session = bytearray()
        elif body.startswith(b" end ") and self._session is not None:
            self.relays_ok = _RELAYS.fullmatch(body) is not None
            self.session_done = True
            self._ended[1] = True
        else:
            raise ProtocolError("an unexpected marker on stdout")

    def flush(self) -> None:
        """Keeps what was held back when the call ends without its end markers (the agent is given up)."""
        for stream, pending in self._pending.items():
            if pending and ((stream == 1 and self._session is None) or (stream == 2 and self.started)):
                self.output.add(stream, bytes(pending))
            pending.clear()


def encode_request(nonce: str, command: str, session: bytes | None) -> bytes:
    """The nonce on a line, then the command up to a NUL (it has none: read back by `read -d ''`),
    then the session: `.` (the agent's own) or its chunks, counted, each up to a NUL (it has none)."""
    head = f"{nonce}\n".encode() + command.encode("utf-8") + b"\0"
    if session is None:
        return head + b".\n"
    chunks = session_chunks(session)
    return head + f"{len(chunks)}\n".encode() + b"".join(chunk + b"\0" for chunk in chunks)


class SessionAgent:
    """The agent of one container, as this process started it; used under the sandbox's lock."""

    def __init__(self, api: Any, exec_id: str, sock: Any):
        self.api, self.exec_id = api, exec_id
        self.stream = ExecStream(sock)
        self._raw = getattr(sock, "_sock", sock)
        self._pid = 0
        self.closed = False
        self.holds: bytes | None = None  # the session the agent resumes when sent `.`
        # A handle dropped without close(): its agent reads the end of its stdin and exits.
        self._finalizer = weakref.finalize(self, _hang_up, self._raw, self.stream)

    @classmethod
    def open(cls, api: Any, container_id: str, shell: str, call_script: str) -> SessionAgent:
        """Starts the agent (one exec); raises the engine's errors as an exec of the call would."""
        argv = [shell, "-c", AGENT_SCRIPT, AGENT_NAME, shell, call_script]
        exec_id = api.exec_create(container_id, argv, stdin=True)["Id"]
        return cls(api, exec_id, api.exec_start(exec_id, socket=True))

    def send(self, command: str, output: Output, session: bytes) -> CallFrames:
        """Hands the call to the agent, to run in `session`. SessionUnavailable: the agent is gone,
        out of step or slow to read (the call did not run)."""
        if self.closed:
            raise SessionUnavailable("the session is closed")
        if self.stream.pending():  # between calls nothing may come: the agent's end, or output out of protocol
            raise SessionUnavailable("the agent ended or wrote between calls")
        try:
            request = encode_request(
                nonce := secrets.token_hex(_NONCE_BYTES), command, None if self.holds == session else session
            )
        except UnicodeEncodeError:  # lone surrogates: the engine's JSON decoding decides what an exec runs
            raise SessionUnavailable("the command is not UTF-8") from None
        self.holds = None  # until the call's end says what the agent holds
        timeout = self._raw.gettimeout()
        try:
            self._raw.settimeout(_WRITE_S)
            self._raw.sendall(request)
        except OSError as exc:  # a timeout included: an agent that stopped reading
            raise SessionUnavailable(f"the agent did not take the call: {exc}") from exc
        finally:
            try:
                self._raw.settimeout(timeout)
            except OSError:
                pass
        return CallFrames(output, nonce)

    def pid(self) -> int:
        """The agent's host pid (0 until the engine reports it)."""
        if not self._pid:
            self._pid = self.api.exec_inspect(self.exec_id).get("Pid") or 0
        return self._pid

    def live_pid(self) -> int:
        """The agent's host pid while it runs, else 0: a dead agent's pid may name another process now."""
        state = self.api.exec_inspect(self.exec_id)
        return (state.get("Pid") or 0) if state.get("Running") else 0

    def close(self) -> None:
        """Hangs up: the agent reads the end of its stdin and exits (the caller kills it if it must)."""
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


class ExecFrames:
    """A call by exec (session.EXEC_SCRIPT) as ExecStream's sink: its output, and the session its
    shell handed back, which EXEC_SCRIPT writes to stdout between the call's markers (`\\0TVC<nonce>
    s` ... `\\0TVC<nonce> end`) in one write: a pipe keeps a write of up to 4 KiB whole, so the
    block is not broken by a process the call left writing to the same stdout (a larger session
    may be). The nonce is in the exec's arguments, so a call can read it and write a block of its
    own: the last block is the session, and an earlier one goes to the output. `end()` once the
    stream is over."""

    finished = False  # an exec's call ends with its stream

    def __init__(self, output: Output, nonce: str):
        self.output = output
        prefix = _MARK + nonce.encode()
        self._start, self._end = prefix + b" s\n", prefix + b" end\n"
        self._pending = bytearray()  # stdout not yet placed: its last bytes may begin a marker
        self._block: bytearray | None = None  # within a block: its bytes so far
        self._found: bytes | None = None
        self.session: bytes | None = None

    @property
    def received(self) -> int:
        return self.output.received

    def add(self, stream: int, data: bytes) -> None:
        if stream != 1:
            self.output.add(stream, data)
            return
        self._pending += data
        while self._pending:
            marker = self._end if self._block is not None else self._start
            at = self._pending.find(marker)
            if at < 0:
                self._keep(len(self._pending) - len(marker) + 1)
                return
            self._keep(at)
            del self._pending[: len(marker)]
            if self._block is None:
                self._block = bytearray()
                continue
            block, self._block = bytes(self._block), None
            if self._found is not None:  # an earlier block was not ours: it is output after all
                self.output.add(1, self._start + self._found + self._end)
            self._found = block

    def _keep(self, size: int) -> None:
        """Places the first `size` pending bytes: in the block being read, else in the output."""
        if size <= 0:
            return
        if self._block is None:
            self.output.add(1, bytes(self._pending[:size]))
        else:
            self._block += self._pending[:size]
            if len(self._block) > _SESSION_MAX_BYTES or b"\0" in self._block:  # no block of ours
                block, self._block = self._start + bytes(self._block), None
                self.output.add(1, block)
        del self._pending[:size]

    def end(self) -> None:
        """The stream is over: what is held back is output, and the last block found the session."""
        rest = (self._start + bytes(self._block) if self._block is not None else b"") + bytes(self._pending)
        self._block, self._pending = None, bytearray()
        if rest:
            self.output.add(1, rest)
        self.session = self._found or None
