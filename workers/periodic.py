"""The periodic jobs (CELERY_BEAT_SCHEDULE: reaping sandboxes and leases, eviction and snapshot
garbage collection, orphans, ...) run in the service's own processes when no Celery beat runs
them: the embedded default, without Redis.

One thread per process (started by the ASGI application, `periodic_jobs_start`) runs each
job on its interval. A run holds a PostgreSQL advisory lock of its own job, taken without waiting:
several processes of the service never run the same job at once, and one that finds it taken
skips that round. The jobs are idempotent, so a round run twice (two processes one after the
other) costs only the work.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time

from django.conf import settings
from django.db import connection
from django.utils.module_loading import import_string

log = logging.getLogger("tvcache.periodic")

FIRST_RUN_S = 2.0  # after the process starts: what a stopped service left behind is reaped soon
_started: int | None = None  # the pid whose thread runs (a forked child starts its own)
_start_lock = threading.Lock()


def periodic_jobs_start() -> bool:
    """Start this process's thread, once; False when the jobs are Celery beat's (a broker is set)
    or the thread runs already."""
    global _started
    if not settings.TVCACHE["PERIODIC_IN_PROCESS"]:
        return False
    with _start_lock:
        if _started == os.getpid():
            return False
        _started = os.getpid()
    schedule = {
        name: (entry["task"], float(entry["schedule"])) for name, entry in settings.CELERY_BEAT_SCHEDULE.items()
    }
    threading.Thread(target=_run_forever, args=(schedule,), name="tvcache-periodic", daemon=True).start()
    return True


def job_lock_key(name: str) -> int:
    """The advisory lock a run of the job `name` holds."""
    return int.from_bytes(hashlib.sha256(f"tvcache periodic job\0{name}".encode()).digest()[:8], "big", signed=True)


def _run_forever(schedule: dict[str, tuple[str, float]]) -> None:
    due = {name: time.monotonic() + FIRST_RUN_S for name in schedule}
    while True:
        name = min(due, key=due.__getitem__)
        time.sleep(max(0.0, due[name] - time.monotonic()))
        task_name, every_s = schedule[name]
        job_run(name, task_name)
        due[name] = time.monotonic() + every_s


def job_run(name: str, task_name: str) -> bool:
    """Run the job once here unless another process runs it now (False). Never raises: a failed
    run (the database or the engine down) is logged and tried again next round."""
    key = job_lock_key(name)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", [key])
            if not cursor.fetchone()[0]:
                return False
        try:
            result = import_string(task_name).apply()  # here, as Celery runs a task without a broker
            if result.failed():
                log.error("periodic job %s failed: %r", name, result.result)
        finally:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
        return True
    except Exception:
        log.exception("periodic job %s could not run", name)
        return False
    finally:
        connection.close()  # given back between rounds (a pooled one to its pool; a dead one dropped)
