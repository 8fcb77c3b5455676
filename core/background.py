"""Background jobs queued by services: the one seam between the services and Celery. A job is a
Celery task named as it is registered (`workers.tasks.<name>`, registered at start by
WorkersConfig.ready), so no service imports the workers app that calls the services.

Two kinds, both sent once the transaction that asked for them commits, from threads of this
process, so the request that asked answers at once whether the broker takes the job, takes its
time refusing it (Redis down: 0.6 to 6 s of reconnect attempts) or is gone:
- `job_enqueue`: work that must be done (warming a sandbox, collecting evicted snapshots). A job
  the broker refuses runs on the sender's thread instead. Embedded (no broker), Celery runs jobs
  in the caller as before.
- `job_offer`: work worth doing only if the broker takes it (the determinism audit of a sampled
  hit): one the broker cannot take is dropped (logged), never run in process.
A job that works on a docker engine's sandboxes names it (`near`, the engine's queue name): it
goes to the queue of the workers next to that engine (`job_queue`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import redis
from celery import current_app
from django.conf import settings
from django.db import connections, transaction

log = logging.getLogger("tvcache.background")

MAX_PENDING = 256  # jobs waiting for the sender threads; more are dropped (logged): see job_enqueue
MAX_OFFERED = 1000  # offered jobs waiting for their sender thread; more are dropped (logged)
_pending = threading.BoundedSemaphore(MAX_PENDING)
_senders: tuple[int, ThreadPoolExecutor] | None = None  # (pid, executor): a forked child makes its own
_senders_lock = threading.Lock()


def _task(name: str):
    """The registered Celery task `name` (KeyError for a name no task has: a programming error)."""
    return current_app.tasks[name]


def _sender() -> ThreadPoolExecutor:
    global _senders, _pending
    if _senders is None or _senders[0] != os.getpid():
        with _senders_lock:
            if _senders is None or _senders[0] != os.getpid():
                _pending = threading.BoundedSemaphore(MAX_PENDING)
                _senders = (os.getpid(), ThreadPoolExecutor(max_workers=2, thread_name_prefix="tvcache-jobs"))
    return _senders[1]


def job_queue(task, near: str | None) -> str | None:
    """`<default queue>.<near>`: the queue of the workers next to `near` (an engine's queue name);
    None: the default queue. Below the default queue, so that installations (and test sessions)
    sharing a broker keep their jobs apart."""
    return f"{task.app.conf.task_default_queue}.{near}" if near else None


def job_enqueue(name: str, *args, near: str | None = None) -> None:
    """Queue the Celery task named `name` with `args` after the current transaction commits (at
    once outside one). Never raises and never blocks for the broker; a job the broker refuses runs
    here. Jobs are idempotent repairs or speed-ups (a warm sandbox, freed storage): one dropped
    when MAX_PENDING are waiting is redone by the periodic jobs (the reaper fails a sandbox row
    that never warmed)."""
    task = _task(name)
    transaction.on_commit(lambda: _submit(task, args, job_queue(task, near)))


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


def job_offer(name: str, *args, near: str | None = None) -> None:
    """Offer the Celery task named `name` with `args` to the broker once the current transaction
    commits. Never raises, never waits: a broker that is down costs the jobs it cannot take
    (logged); so does a full outbox, and a process that exits before its outbox is empty."""
    task = _task(name)
    try:
        transaction.on_commit(lambda: _outbox.put((task, args, job_queue(task, near))))
    except Exception as exc:
        log.warning("could not queue %s%r: %s", name, args, exc)


class _Outbox:
    """Offered jobs on their way to the broker, sent by a thread of its own: the caller never
    waits for Redis (a publish to a broker that is down took 6.6 s here before it failed, however
    told not to retry)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.lock = threading.Lock()
        self.pid: int | None = None
        self.jobs: queue.Queue = queue.Queue(maxsize=capacity)

    def put(self, job: tuple) -> None:
        self._started()
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            log.warning("outbox full (broker slow or down): %s%r dropped", job[0].name, job[1])

    def _started(self) -> None:
        if self.pid == os.getpid():
            return
        with self.lock:
            if self.pid != os.getpid():  # first use, or a forked child: a thread of its own
                self.jobs = queue.Queue(maxsize=self.capacity)
                threading.Thread(target=self._send, args=(self.jobs,), name="tvcache-outbox", daemon=True).start()
                self.pid = os.getpid()

    @staticmethod
    def _send(jobs: queue.Queue) -> None:
        while True:
            task, args, queue_name = jobs.get()
            try:
                task.apply_async(args, retry=False, queue=queue_name)
            except Exception as exc:  # the broker is down: this job is dropped
                log.warning("could not queue %s%r: %s", task.name, args, exc)


_outbox = _Outbox(capacity=MAX_OFFERED)


# --- Are the jobs taken? -----------------------------------------------------------------------
# A broker with no worker takes every job and runs none (the determinism audit, warm sandboxes,
# snapshot collection): each worker says it is alive in Redis, per queue it consumes, and the
# health endpoint, /metrics and the dashboard read it (docs/operations/deploy.md).

HEARTBEAT_S = 10.0
HEARTBEAT_STALE_S = 3 * HEARTBEAT_S
REDIS_TIMEOUT_S = 0.5
# kombu's Redis transport keeps a queue as one list per priority step: "<queue>", then
# "<queue>\x06\x16<step>" for steps 3, 6 and 9 (its default priority_steps).
KOMBU_PRIORITY_SUFFIXES = ("", "\x06\x163", "\x06\x166", "\x06\x169")
_redis_clients: dict[str, redis.Redis] = {}


def _heartbeats_key(queue_name: str) -> str:
    return f"tvcache:workers:{queue_name}"


def _redis(url: str) -> redis.Redis:
    client = _redis_clients.get(url)
    if client is None:
        client = _redis_clients.setdefault(
            url, redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
        )
    return client


@dataclass(frozen=True, slots=True)
class Backlog:
    """The default queue as the broker holds it: `broker_up` False leaves the rest unknown."""

    queue: str
    broker_up: bool
    waiting: int = 0  # jobs in the queue
    workers: int = 0  # workers that said they were alive in the last HEARTBEAT_STALE_S

    @property
    def stalled(self) -> bool:
        """Jobs wait and no worker is there to take them."""
        return self.broker_up and self.waiting > 0 and self.workers == 0


def backlog() -> Backlog | None:
    """The default queue's backlog and live workers (one Redis round trip, bounded by
    REDIS_TIMEOUT_S); None when embedded: jobs run in process, there is no queue."""
    url = settings.REDIS_URL
    if not url or current_app.conf.task_always_eager:
        return None
    queue_name = current_app.conf.task_default_queue
    now = time.time()
    try:
        with _redis(url).pipeline(transaction=False) as pipe:
            for suffix in KOMBU_PRIORITY_SUFFIXES:
                pipe.llen(queue_name + suffix)
            pipe.zcount(_heartbeats_key(queue_name), now - HEARTBEAT_STALE_S, "+inf")
            *depths, workers = pipe.execute()
    except redis.RedisError as exc:
        log.warning("the broker did not answer: %s", exc)
        return Backlog(queue_name, broker_up=False)
    return Backlog(queue_name, broker_up=True, waiting=sum(depths), workers=workers)


def heartbeat_start(name: str, queue_names: list[str]) -> None:
    """In a worker: say every HEARTBEAT_S that worker `name` consumes `queue_names`, from a thread
    of its own, for as long as the process lives. A beat the broker misses is logged, not fatal."""

    def beat() -> None:
        while True:
            now = time.time()
            try:
                with _redis(settings.REDIS_URL).pipeline(transaction=False) as pipe:
                    for queue_name in queue_names:
                        key = _heartbeats_key(queue_name)
                        pipe.zadd(key, {name: now})
                        pipe.zremrangebyscore(key, "-inf", now - HEARTBEAT_STALE_S)
                        pipe.expire(key, int(HEARTBEAT_STALE_S) * 2)
                    pipe.execute()
            except redis.RedisError as exc:
                log.warning("worker heartbeat not sent: %s", exc)
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, name="tvcache-heartbeat", daemon=True).start()
