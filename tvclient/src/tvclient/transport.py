"""How the sync client moves an operation: keep-alive HTTP/1.1 over the standard library.

A lookup is the one request a rollout makes on every tool call, so its client-side cost is part
of the overhead a miss adds. httpx spends about 1.6 ms of CPU per lookup on the machines we
measure on (request and URL models, h11, cookies), which under eight rollout threads and the
GIL became most of a miss's lookup time; `http.client` on a kept connection spends about 0.4 ms.
Each thread keeps one connection, so rollouts on threads never wait on each other's requests.
"""

from __future__ import annotations

import http.client
import json
import select
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

# What failing to reach the service or to read its answer raises.
TransportFailure = (OSError, http.client.HTTPException)


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    content: bytes
    reason: str = ""
    server_ms: float | None = None  # the service's own time (Server-Timing "total"), if it said
    retry_after: str | None = None  # the Retry-After header, if any


def retry_after_s(header: str | None) -> float | None:
    """Seconds a Retry-After header asks to wait (its delay-seconds form; a date is ignored)."""
    try:
        return max(0.0, float(header)) if header else None
    except ValueError:
        return None


def server_ms(header: str | None) -> float | None:
    """The "total" metric of a Server-Timing header ("queue;dur=0.2, app;dur=1.1, total;dur=1.6")."""
    for metric in (header or "").split(","):
        name, _, params = metric.strip().partition(";")
        if name == "total":
            for param in params.split(";"):
                key, _, value = param.strip().partition("=")
                if key == "dur":
                    try:
                        return float(value)
                    except ValueError:
                        return None
    return None


class Connections:
    """One keep-alive connection per calling thread to `base_url` (http or https, with an
    optional path prefix). A connection the server closed while idle is reopened before use."""

    def __init__(self, base_url: str, headers: Mapping[str, str], timeout: float) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        self._open = lambda: kind(url.hostname, url.port, timeout=timeout)
        self._prefix = url.path.rstrip("/")
        self._headers = dict(headers)
        self._local = threading.local()
        self._lock = threading.Lock()
        # Weakly: a thread's connection goes (and its socket closes) with the thread.
        self._all: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()

    def request(self, method: str, path: str, body: Any = None, params: Mapping[str, Any] | None = None) -> Reply:
        """The service's answer; raises one of TransportFailure when there is none."""
        target = self._prefix + path + (f"?{urlencode(params)}" if params else "")
        headers = self._headers
        payload = None
        if body is not None:
            payload = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
            headers = {**headers, "Content-Type": "application/json"}
        connection = self._connection()
        try:
            connection.request(method, target, payload, headers)
            response = connection.getresponse()
            content = response.read()
        except BaseException:
            connection.close()  # a half-read answer must not be read as the next one's
            raise
        if response.will_close:
            connection.close()
        return Reply(
            response.status,
            content,
            response.reason,
            server_ms(response.getheader("Server-Timing")),
            response.getheader("Retry-After"),
        )

    def close(self) -> None:
        with self._lock:
            connections, self._all = list(self._all), weakref.WeakSet()
        for connection in connections:
            connection.close()

    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = self._local.connection = self._open()
            with self._lock:
                self._all.add(connection)
        elif connection.sock is not None and _readable(connection.sock):
            # Nothing is owed on an idle connection: readable means the server closed it.
            connection.close()  # http.client opens it again on the next request
        return connection


def _readable(sock) -> bool:
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True
