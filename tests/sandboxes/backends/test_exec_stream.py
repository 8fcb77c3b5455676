"""The exec stream reader keeps the output the HTTP client read ahead with the headers."""

import io
import socket
import struct
import time
from types import SimpleNamespace

from sandboxes.backends.docker.execstream import ExecStream, Output, Stop


def frame(stream: int, data: bytes) -> bytes:
    return struct.pack(">BxxxL", stream, len(data)) + data


def test_output_buffered_with_the_response_headers_is_not_lost():
    ours, engine = socket.socketpair()
    raw = socket.SocketIO(ours, "rb")
    buffered = io.BufferedReader(raw)
    # The engine's answer and the whole output of a short call arrive in one segment.
    engine.sendall(b"HTTP/1.1 101 UPGRADED\r\n\r\n" + frame(1, b"wrote test_stats.py\n"))
    engine.shutdown(socket.SHUT_WR)
    while buffered.readline() not in (b"\r\n", b""):  # what http.client does with the headers
        pass
    raw._response = SimpleNamespace(raw=SimpleNamespace(_fp=SimpleNamespace(fp=buffered)))
    output = Output(cap=1024)
    stream = ExecStream(raw)
    assert stream.pump(output, time.monotonic() + 5, flood_bytes=1 << 20) is Stop.EOF
    assert output.text(1) == "wrote test_stats.py\n"
    engine.close()
    ours.close()
