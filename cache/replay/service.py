"""A live tvcache for the replay: the ASGI app under uvicorn plus a Celery worker (proactive
forks), both in subprocesses, on a Celery queue of their own so no other worker takes the jobs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

import httpx
from django.conf import settings

from dashboard.browser import database_url, free_port

START_TIMEOUT_S = 30.0


@contextlib.contextmanager
def service_running(*, db: dict, redis_url: str, log_dir: Path | None = None, worker: bool = True) -> Iterator[str]:
    """Serve tvcache on a free loopback port (yields its base URL), with a worker unless told not to."""
    queue = f"tvcache-replay-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "DATABASE_URL": database_url(db), "REDIS_URL": redis_url, "CELERY_QUEUE": queue,
           "DJANGO_SETTINGS_MODULE": "tvcache_site.settings", "DEBUG": "0",
           # A psycopg pool per process, as the run command serves: ASGI runs each request in a new
           # thread, and per-thread persistent connections would pile up.
           "DB_POOL_SIZE": os.environ.get("DB_POOL_SIZE", "8")}
    port = free_port()
    commands = {"uvicorn": [sys.executable, "-m", "uvicorn", "tvcache_site.asgi:application", "--host", "127.0.0.1",
                            "--port", str(port), "--log-level", "warning", "--no-access-log"]}
    if worker and redis_url:
        commands["celery"] = [sys.executable, "-m", "celery", "-A", "tvcache_site", "worker", "-Q", queue,
                              "--pool", "threads", "--concurrency", "2", "-l", "warning", "--without-heartbeat",
                              "--without-gossip", "--without-mingle"]
    processes: list[subprocess.Popen] = []
    logs = []
    try:
        for name, argv in commands.items():
            log = open(log_dir / f"{name}.log", "wb") if log_dir else subprocess.DEVNULL
            logs.append(log)
            processes.append(subprocess.Popen(argv, cwd=settings.BASE_DIR, env=env, stdout=log, stderr=subprocess.STDOUT))
        base = f"http://127.0.0.1:{port}"
        _wait_until_up(base, processes[0])
        yield base
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in logs:
            if log is not subprocess.DEVNULL:
                log.close()
        _drain_queue(redis_url, queue)


def _wait_until_up(base: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"uvicorn exited with {process.returncode}")
        try:
            if httpx.get(base + "/api/schema/", timeout=2.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the service did not answer within {START_TIMEOUT_S} s")
        time.sleep(0.2)


def _drain_queue(redis_url: str, queue: str) -> None:
    if not redis_url:
        return
    from tvcache_site.celery import app

    with contextlib.suppress(Exception), app.connection_for_write() as connection:
        connection.default_channel.queue_delete(queue)
