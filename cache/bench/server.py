"""Start and stop the service as deployed, for benchmarks: production settings, several workers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]

SERVERS = {
    # WSGI, sync workers: the lookup path is synchronous Django + PostgreSQL.
    "gunicorn": lambda port, workers: [sys.executable, "-m", "gunicorn", "tvcache_site.wsgi:application",
                                       "-b", f"127.0.0.1:{port}", "-w", str(workers), "--keep-alive", "75",
                                       "--log-level", "warning", "--worker-class", "sync"],
    # WSGI, uWSGI's C HTTP parser with keep-alive: the fastest option measured here.
    "uwsgi": lambda port, workers: [str(Path(sys.executable).with_name("uwsgi")), "--http-socket", f"127.0.0.1:{port}",
                                    "--module", "tvcache_site.wsgi:application", "--processes", str(workers),
                                    "--master", "--disable-logging", "--http-keepalive", "--enable-threads",
                                    "--lazy-apps", "--thunder-lock", "--die-on-term"],
    # ASGI (HTTP + websockets), the application the run command serves.
    "uvicorn": lambda port, workers: [sys.executable, "-m", "uvicorn", "tvcache_site.asgi:application",
                                      "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers),
                                      "--log-level", "warning", "--no-access-log", "--http", "httptools",
                                      "--loop", "uvloop"],
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(kind: str, workers: int, env: dict[str, str] | None = None):
    port = free_port()
    environment = {**os.environ, "DEBUG": "0", **(env or {})}
    process = subprocess.Popen(SERVERS[kind](port, workers), cwd=ROOT, env=environment)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/api/schema/", timeout=2)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"{kind} did not start on {url}")
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
