"""Start and stop the service as deployed (benchmarks, the replay, browser and ASGI tests):
`manage.py serve --web-only` (its command line is the one place that says how tvcache is served)
with production settings on a free loopback port, optionally a Celery worker on a queue of its
own; what is around it here is the lab's: the environment, waiting, stopping, crashing."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import httpx

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60.0


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


@dataclass
class RunningServer:
    url: str
    pid: int  # uvicorn's main process (a new one after restart())
    queue: str | None = None  # where its background jobs go (a queue of its own), if it has a broker
    worker_pid: int | None = None  # its Celery worker's, if it has one
    _restart: Callable[[bool], int] | None = field(default=None, repr=False, compare=False)

    def cpu_s(self) -> float:
        """CPU seconds (user + system) used so far by the server and its live child processes."""
        return sum(_cpu_s(pid) for pid in process_tree(self.pid))

    def restart(self) -> None:
        """Kill the web server (SIGKILL to its whole process tree: a crash, requests in flight get
        no answer) and start it again on the same port, database and queue; returns once it
        answers. The Celery worker keeps running."""
        self.outage_begin()
        self.outage_end()

    def outage_begin(self) -> None:
        """Kill the web server as restart() does, and leave it down."""
        if self._restart is None:
            raise RuntimeError("this server cannot be restarted")
        self._restart(False)

    def outage_end(self) -> None:
        """Start the web server killed by outage_begin() again; returns once it answers."""
        if self._restart is None:
            raise RuntimeError("this server cannot be restarted")
        self.pid = self._restart(True)


def process_tree(root: int) -> list[int]:
    """`root` and its descendants' pids, parents first."""
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


def crash(root: int) -> None:
    """SIGKILL to `root` and its descendants at once, as a crash (or the OOM killer) would."""
    for pid in process_tree(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def service_running(
    *,
    workers: int = 2,
    db: dict | None = None,
    redis_url: str | None = None,
    celery: bool = False,
    beat: bool = False,
    log_dir: Path | None = None,
    ready_path: str = "/api/schema/",
    root: Path = ROOT,
    release_on_stop: bool = False,
    app: str | None = None,
) -> Iterator[RunningServer]:
    """Serve tvcache as deployed (`manage.py serve --web-only`: production settings, `workers`
    processes, a psycopg pool of 16 per process) on a free loopback port, on `db` and `redis_url`
    (default: this process's environment). With `celery`, a Celery worker too (2 threads; with
    `beat`, the periodic tasks: reaping, eviction, vacuum). With a broker the service queues its
    background jobs on a queue of its own, so that no other worker (on another database) takes
    them; the queue is deleted afterwards. So with a broker but without `celery` those jobs are
    queued and never run: the caller measures the request path alone, or starts its own worker on
    `RunningServer.queue`. Without a Redis URL there is no worker: the service then runs its
    background work in process (its embedded default). Logs go to `log_dir` if given. `root`: the
    checkout served (another one than this, to measure it). With `release_on_stop`, once stopped
    it stops the sandboxes of the instance's database, as the run command does
    (`manage.py release_sandboxes`). `app`: another ASGI application served the same way (the
    hits benchmark's bare floor)."""
    broker = os.environ.get("REDIS_URL", "") if redis_url is None else redis_url
    queue = f"tvcache-{uuid.uuid4().hex[:8]}" if broker else None
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tvcache_site.settings",
        "DEBUG": "0",
        # Smaller than the run command's default: the benchmarks' figures were measured with 16.
        "DB_POOL_SIZE": os.environ.get("DB_POOL_SIZE", "16"),
    }
    if db is not None:
        env["DATABASE_URL"] = database_url(db)
    env["REDIS_URL"] = broker
    if queue:
        env["CELERY_QUEUE"] = queue
    port = free_port()
    # The log keeps uvicorn's name: serve itself writes to it only when uvicorn exits.
    commands = {
        "uvicorn": [
            sys.executable,
            "manage.py",
            "serve",
            "--web-only",
            "--port",
            str(port),
            "--workers",
            str(workers),
            *(["--app", app] if app else []),
        ]
    }
    if queue and celery:
        commands["celery"] = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tvcache_site",
            "worker",
            "-Q",
            queue,
            "-n",
            f"{queue}@%h",
            "--pool",
            "threads",
            "--concurrency",
            "2",
            "-l",
            "info",
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
        ]
        if beat:
            commands["celery"] += [
                "-B",
                "-s",
                str(Path(log_dir or tempfile.mkdtemp(prefix="tvcache-beat-")) / f"{queue}-beat-schedule"),
            ]
    with contextlib.ExitStack() as stack:
        processes = []
        logs = {
            name: stack.enter_context(open(log_dir / f"{name}.log", "wb")) if log_dir else subprocess.DEVNULL
            for name in commands
        }
        url = f"http://127.0.0.1:{port}"

        def restart_web(start: bool) -> int:
            old = processes[0]
            if not start:
                crash(old.pid)  # serve, uvicorn and its workers: they hold the listening socket
                old.wait()
                wait_until(lambda: not answers(url, ready_path), START_TIMEOUT_S, f"the service on {url} to stop")
                return old.pid
            processes[0] = subprocess.Popen(
                commands["uvicorn"], cwd=root, env=env, stdout=logs["uvicorn"], stderr=subprocess.STDOUT
            )
            wait_until(
                lambda: answers(url, ready_path), START_TIMEOUT_S, f"the service on {url} (restarted)", processes
            )
            return _uvicorn_pid(processes[0])

        try:
            for name, argv in commands.items():
                processes.append(subprocess.Popen(argv, cwd=root, env=env, stdout=logs[name], stderr=subprocess.STDOUT))
            wait_until(lambda: answers(url, ready_path), START_TIMEOUT_S, f"the service on {url}", processes)
            if "celery" in commands:
                wait_until(
                    lambda: _worker_answers(broker, f"{queue}@{socket.gethostname()}"),
                    START_TIMEOUT_S,
                    "the Celery worker",
                    processes,
                )
            yield RunningServer(
                url,
                _uvicorn_pid(processes[0]),
                queue,
                processes[1].pid if len(processes) > 1 else None,
                restart_web,
            )
        finally:
            stop(processes, timeout_s=30)
            if release_on_stop:
                subprocess.run(
                    [sys.executable, "manage.py", "release_sandboxes"], cwd=root, env=env, check=False, timeout=300
                )
            if queue:
                _queue_delete(broker, queue)


def _uvicorn_pid(serve: subprocess.Popen) -> int:
    # `serve --web-only` has one child, uvicorn's main process (its workers are that one's).
    return process_tree(serve.pid)[1]


def database_url(db: dict) -> str:
    """A DATABASE_URL for Django's connection settings `db`."""
    user = quote(db.get("USER") or "postgres", safe="")
    password = f":{quote(db['PASSWORD'], safe='')}" if db.get("PASSWORD") else ""
    host = db.get("HOST") or "127.0.0.1"
    port = db.get("PORT") or 5432
    return f"postgres://{user}{password}@{host}:{port}/{db['NAME']}"


def _worker_answers(broker: str, name: str) -> bool:
    # An app of its own on `broker`: the project's app would send the ping through this
    # process's broker, which need not be the service's.
    from celery import Celery

    app = Celery(broker=broker)
    try:
        return bool(app.control.ping(destination=[name], timeout=0.5))
    finally:
        app.close()


def _queue_delete(broker: str, queue: str) -> None:
    from kombu import Connection

    with contextlib.suppress(Exception), Connection(broker) as connection:
        connection.default_channel.queue_delete(queue)
