"""Background jobs queued by services (warming a sandbox, collecting evicted snapshots).

A job is sent to the broker once the transaction that asked for it commits, from a thread of
this process: the request that asked for it has done its work and answers at once, whether the
broker takes the job, takes its time refusing it (Redis down: 0.6 to 6 s of reconnect attempts)
or is gone. A job the broker refuses runs on that thread instead. Embedded (no broker), Celery
runs jobs in the caller as before.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from django.db import connections, transaction

log = logging.getLogger("tvcache.background")

MAX_PENDING = 256  # jobs waiting for the sender threads; more are dropped (logged): see job_enqueue
_pending = threading.BoundedSemaphore(MAX_PENDING)
_senders: tuple[int, ThreadPoolExecutor] | None = None  # (pid, executor): a forked child makes its own
_senders_lock = threading.Lock()


def _sender() -> ThreadPoolExecutor:
    global _senders, _pending
    if _senders is None or _senders[0] != os.getpid():
        with _senders_lock:
            if _senders is None or _senders[0] != os.getpid():
                _pending = threading.BoundedSemaphore(MAX_PENDING)
                _senders = (os.getpid(), ThreadPoolExecutor(max_workers=2, thread_name_prefix="tvcache-jobs"))
    return _senders[1]


def job_enqueue(task, *args, near: str | None = None) -> None:
    """Queue the Celery task `task(*args)` after the current transaction commits (at once outside
    one). Never raises and never blocks for the broker; a job the broker refuses runs here. Jobs
    are idempotent repairs or speed-ups (a warm sandbox, freed storage): one dropped when
    MAX_PENDING are waiting is redone by the periodic jobs (the reaper fails a sandbox row that
    never warmed). `near`: the job works on a docker engine's sandboxes; it goes to the queue of
    the workers next to that engine (job_queue)."""
    transaction.on_commit(lambda: _submit(task, args, job_queue(task, near)))


def job_queue(task, near: str | None) -> str | None:
    """`<default queue>.<near>`: the queue of the workers next to `near` (an engine's queue name);
    None: the default queue. Below the default queue, so that installations (and test sessions)
    sharing a broker keep their jobs apart."""
    return f"{task.app.conf.task_default_queue}.{near}" if near else None


def _submit(task, args: tuple, queue: str | None) -> None:
    if task.app.conf.task_always_eager:  # embedded: runs here, as Celery does without a broker
        try:
            task.apply_async(args, queue=queue)
        except Exception:
            log.exception("background job %s%r failed", task.name, args)
        return
    sender = _sender()
    if not _pending.acquire(blocking=False):
        log.error("%d background jobs waiting: %s%r dropped", MAX_PENDING, task.name, args)
        return
    try:
        sender.submit(_send, task, args, queue)
    except RuntimeError:  # the interpreter is shutting down
        _pending.release()


def _send(task, args: tuple, queue: str | None) -> None:
    try:
        try:
            task.apply_async(args, retry=False, queue=queue)
        except Exception as exc:  # the broker is down or refused: do the work here
            log.warning("broker unavailable (%s): running %s%r in process", exc, task.name, args)
            result = task.apply(args)
            if result.failed():
                log.error("background job %s%r failed in process: %r", task.name, args, result.result)
    except Exception:
        log.exception("background job %s%r failed", task.name, args)
    finally:
        _pending.release()
        connections.close_all()  # this thread's, if the job used any
