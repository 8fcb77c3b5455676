"""A call's output as docker's exec stream carries it: frames of an 8-byte header (stream, 0, 0,
0, size) and data, read until the command ends (the stream's end, or the end a session agent
marks: agent.py), its deadline passes or it floods."""

from __future__ import annotations

import enum
import select
import struct
import time
from collections.abc import Callable
from typing import Any


class Stop(enum.Enum):
    EOF = "eof"
    DEADLINE = "deadline"
    FLOOD = "flood"
    DONE = "done"  # the sink has the call's end (a session agent's markers)


class Output:
    """stdout/stderr of one call, each kept up to `cap` bytes."""

    finished = False  # an exec's call ends with its stream

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
    """Reads docker's multiplexed exec stream of one call."""

    def __init__(self, sock: Any):
        self._sock = sock
        self._recv = getattr(sock, "recv", None) or sock.read
        self._buffer = bytearray(_read_ahead(sock))

    def pump(self, output: Any, deadline: float, flood_bytes: float, until: Callable[[], bool] | None = None) -> Stop:
        """Frames into `output` (an Output, or a sink with `add`, `received` and `finished`) until
        the stream ends, the sink is finished or `until()` holds, the deadline passes or more than
        `flood_bytes` came."""
        self._drain(output)  # frames read ahead with the response headers
        while True:
            if output.finished or (until is not None and until()):
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
            self._drain(output)
            if output.received > flood_bytes:
                return Stop.FLOOD

    def pending(self) -> bool:
        """Whether anything (data or the stream's end) waits to be read, without blocking."""
        return bool(self._buffer) or bool(select.select([self._sock], [], [], 0)[0])

    def _drain(self, output: Any) -> None:
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
