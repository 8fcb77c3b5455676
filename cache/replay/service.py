"""A live tvcache for the replay: the ASGI app under uvicorn plus a Celery worker (proactive
forks), both in subprocesses, on a Celery queue of their own so no other worker takes the jobs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Iterator

from django.conf import settings

from cache.bench.server import SERVERS, answers, free_port, stop, wait_until
from dashboard.browser import database_url

START_TIMEOUT_S = 30.0
UVICORN_WORKERS = 2  # as the run command serves


@contextlib.contextmanager
def service_running(*, db: dict, redis_url: str, log_dir: Path | None = None, worker: bool = True) -> Iterator[str]:
    """Serve tvcache on a free loopback port (yields its base URL), with a worker unless told not to."""
    queue = f"tvcache-replay-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "DATABASE_URL": database_url(db), "REDIS_URL": redis_url, "CELERY_QUEUE": queue,
           "DJANGO_SETTINGS_MODULE": "tvcache_site.settings", "DEBUG": "0",
           # A psycopg pool per process, as the run command serves: ASGI runs each request in a new
           # thread, and per-thread persistent connections would pile up.
           "DB_POOL_SIZE": os.environ.get("DB_POOL_SIZE", "16")}
    port = free_port()
    commands = {"uvicorn": SERVERS["uvicorn"](port, UVICORN_WORKERS)}
    if worker and redis_url:
        commands["celery"] = [sys.executable, "-m", "celery", "-A", "tvcache_site", "worker", "-Q", queue,
                              "--pool", "threads", "--concurrency", "2", "-l", "warning", "--without-heartbeat",
                              "--without-gossip", "--without-mingle",
                              # The periodic tasks too (reaping, eviction, table statistics), as deployed.
                              "-B", "-s", str((log_dir or Path(tempfile.mkdtemp(prefix="tvcache-beat-"))) / "celerybeat-schedule")]
    processes: list[subprocess.Popen] = []
    logs = []
    try:
        for name, argv in commands.items():
            log = open(log_dir / f"{name}.log", "wb") if log_dir else subprocess.DEVNULL
            logs.append(log)
            processes.append(subprocess.Popen(argv, cwd=settings.BASE_DIR, env=env, stdout=log, stderr=subprocess.STDOUT))
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: answers(base), START_TIMEOUT_S, "the service", processes[:1])
        yield base
    finally:
        stop(processes)
        for log in logs:
            if log is not subprocess.DEVNULL:
                log.close()
        _drain_queue(redis_url, queue)


def _drain_queue(redis_url: str, queue: str) -> None:
    if not redis_url:
        return
    from tvcache_site.celery import app

    with contextlib.suppress(Exception), app.connection_for_write() as connection:
        connection.default_channel.queue_delete(queue)
