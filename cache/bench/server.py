"""Start and stop the service as deployed (benchmarks, the replay and browser tests): production
settings, several workers, a free loopback port. The one place that knows how to bring a server
up and down in a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]

SERVERS = {
    # WSGI, uWSGI's C HTTP parser: the fastest option measured here. A sync worker serves one
    # connection at a time, so it closes each after its response (as gunicorn's sync workers do);
    # uWSGI's http-socket does that without saying so, and clients then lose a round trip (or the
    # request) on the dead connection: the header tells them. (--http-keepalive only applies to
    # uWSGI's separate HTTP router process, which cost more CPU per request than it saved here.)
    "uwsgi": lambda port, workers: [str(Path(sys.executable).with_name("uwsgi")), "--http-socket", f"127.0.0.1:{port}",
                                    "--module", "tvcache_site.wsgi:application", "--processes", str(workers),
                                    "--master", "--disable-logging", "--add-header", "Connection: close",
                                    "--enable-threads", "--lazy-apps", "--thunder-lock", "--die-on-term"],
    # ASGI (HTTP + websockets), the application the run command serves: the deployment.
    "uvicorn": lambda port, workers: [sys.executable, "-m", "uvicorn", "tvcache_site.asgi:application",
                                      "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers),
                                      "--log-level", "warning", "--no-access-log", "--http", "httptools",
                                      "--loop", "uvloop"],
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers(url: str, path: str = "/api/schema/") -> bool:
    """The server at `url` answers HTTP (any status)."""
    try:
        httpx.get(url + path, timeout=2)
        return True
    except httpx.TransportError:
        return False


def wait_until(predicate, timeout_s: float, what: str, processes=()) -> None:
    """Poll `predicate` until it holds; fail when a process exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
            raise RuntimeError(f"{what} did not come up")
        time.sleep(0.2)


def stop(processes, timeout_s: float = 15) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class RunningServer:
    url: str
    pid: int

    def cpu_s(self) -> float:
        """CPU seconds (user + system) used so far by the server and its live child processes."""
        return sum(_cpu_s(pid) for pid in _tree(self.pid))


def _tree(root: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def running_server(kind: str, workers: int, env: dict[str, str] | None = None):
    port = free_port()
    environment = {**os.environ, "DEBUG": "0", "DB_POOL_SIZE": os.environ.get("DB_POOL_SIZE", "16"), **(env or {})}
    process = subprocess.Popen(SERVERS[kind](port, workers), cwd=ROOT, env=environment)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers(url), 30, f"{kind} on {url}", [process])
        yield RunningServer(url, process.pid)
    finally:
        stop([process], timeout_s=10)
