"""Serve tvcache until SIGTERM or Ctrl-C, then stop everything it started, sandboxes included.

Starts uvicorn (the ASGI application, --workers processes) and, with REDIS_URL, a Celery worker
with the periodic jobs (beat); without Redis the service runs its periodic jobs in process. Each
runs in a process group of its own, so that stopping it reaches its children (uvicorn's workers,
Celery's pool). On SIGTERM or SIGINT: SIGTERM to each group, SIGKILL after --grace seconds (a tool
still running holds its worker), then every sandbox of this installation is stopped
(`sandboxes_release`): no container outlives the service. Results and snapshots stay.

With --web-only it runs uvicorn alone: the web processes of a deployment whose Celery workers and
sandboxes are run (and stopped) elsewhere, such as another host's `serve` or the lab's launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from django.conf import settings
from django.core.management.base import BaseCommand

from sandboxes.services import sandboxes_release


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--workers", type=int, default=2)
        parser.add_argument("--grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL")
        parser.add_argument(
            "--web-only", action="store_true", help="no Celery worker, and stopping leaves the sandboxes running"
        )
        parser.add_argument(
            "--app",
            default="tvcache_site.asgi:application",
            help="the ASGI application uvicorn serves (the hits benchmark serves its bare floor this way)",
        )

    def handle(self, *args, host, port, workers, grace, web_only, app, **options):
        # A signal handler runs between two bytecodes of the main thread, maybe while it holds a
        # lock: one that takes a lock (Event.set) can deadlock it for good, and then no signal
        # stops the service. It only appends to a list; the loop sleeps, which a signal cuts short.
        stopping: list[int] = []
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda signum, _: stopping.append(signum))
        processes = self._started(app, host, port, workers, celery=bool(settings.REDIS_URL) and not web_only)
        try:
            while not stopping:
                time.sleep(0.5)
                exited = [p for p in processes if p.poll() is not None]
                if exited:
                    self.stderr.write(f"{exited[0].args[2]} exited with status {exited[0].returncode}: stopping")
                    break
        finally:
            _stop(processes, grace)
            if not web_only:
                released = sandboxes_release()
                self.stdout.write(
                    f"stopped; {released['sandboxes']} sandboxes and {released['orphans']} orphans removed"
                )

    @staticmethod
    def _started(app: str, host: str, port: int, workers: int, *, celery: bool) -> list[subprocess.Popen]:
        # The pool: the tool-run lane's threads hold a connection each while a tool runs, plus the
        # other lanes' threads and Django's own.
        env = {
            **os.environ,
            "DB_POOL_SIZE": os.environ.get("DB_POOL_SIZE", str(settings.TVCACHE["TOOLSERVER_THREADS"] + 12)),
        }
        commands = [
            [
                sys.executable,
                "-m",
                "uvicorn",
                app,
                "--host",
                host,
                "--port",
                str(port),
                "--workers",
                str(workers),
                "--log-level",
                "warning",
                "--no-access-log",
                "--http",
                "httptools",
                "--loop",
                "uvloop",
                "--timeout-graceful-shutdown",
                "10",
            ]
        ]
        if celery:
            schedule = settings.VAR_DIR / "celerybeat-schedule"
            schedule.parent.mkdir(parents=True, exist_ok=True)
            commands.append(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "tvcache_site",
                    "worker",
                    "-B",
                    "-s",
                    str(schedule),
                    "-Q",
                    settings.CELERY_TASK_DEFAULT_QUEUE,
                    "--concurrency",
                    "2",
                    "-l",
                    "warning",
                ]
            )
        return [subprocess.Popen(argv, cwd=settings.BASE_DIR, env=env, start_new_session=True) for argv in commands]


def _stop(processes: list[subprocess.Popen], grace: float) -> None:
    for process in processes:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:  # the group: workers left behind by a parent that exited too
        _signal_group(process, signal.SIGKILL)
        process.wait()


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass
