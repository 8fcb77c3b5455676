"""Calls for the tool-server tests, and Celery workers of their own."""

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from celery.contrib.testing.worker import start_worker

from sandboxes.services.reserved import settle
from tvcache_site.celery import app as celery_app


def bash(command: str, **args) -> dict:
    return {"tool": "bash", "args": {"command": command, **args}}


def run(api, task_id: str, rollout_id: str, call: dict, status: int = 200, *, settled: bool = True, **fields) -> dict:
    """A tool-server call (`fields`: the body's others, e.g. epoch). `settled`: returns once the
    snapshot its miss may have handed off is taken (it is taken after the answer,
    sandboxes/services/reserved.py), so that what the test looks at next is the graph the call left."""
    response = api.post(f"/api/v1/tasks/{task_id}/rollouts/{rollout_id}/calls", {"call": call, **fields}, format="json")
    assert response.status_code == status, response.content
    if settled:
        assert settle(), "background snapshots still running"
    return response.json()


# Processes a first call leaves running (docs/design/state.md): the call, a probe of them, and what a
# live rollout answers.
BACKGROUND = (
    "sleep 300 >/dev/null 2>&1 & echo $! > /pid; echo started",
    "kill -0 $(cat /pid) 2>/dev/null && echo alive || echo gone",
    "alive\n",
)
DAEMON = (
    "mkdir -p /www && echo page > /www/x && busybox httpd -p 8089 -h /www && echo started",
    "wget -qO- http://127.0.0.1:8089/x 2>/dev/null || echo unreachable",
    "page\n",
)
# A writer loop: the state after the call depends on how long ago it started. Its probe asks only
# whether it still runs, which a live rollout always sees.
WRITER = (
    "(while :; do echo x >> /log; sleep 0.05; done) >/dev/null 2>&1 & while [ ! -s /log ]; do :; done; echo started",
    "n=$(wc -l < /log); i=0; while [ $i -lt 40 ]; do [ $(wc -l < /log) -gt $n ] && break; sleep 0.05; "
    "i=$((i + 1)); done; [ $(wc -l < /log) -gt $n ] && echo growing || echo stopped",
    "growing\n",
)
# Python's http.server in the debian image, answering once it listens.
PY_GET = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/x', timeout=5).read().decode(), end='')"
HTTP = (
    "mkdir -p /srv && echo page > /srv/x && cd /srv && (python3 -m http.server 8000 >/dev/null 2>&1 &) && "
    f'for i in $(seq 100); do python3 -c "{PY_GET}" >/dev/null 2>&1 && break; sleep 0.05; done; echo started',
    f'python3 -c "{PY_GET}" 2>/dev/null || echo unreachable',
    "page\n",
)


def answers_of_later_rollouts(api, task: str, start: dict, probe: str, rollouts: int = 3) -> list[str]:
    """Each later rollout hits the first call and misses on its own variant of the probe."""
    answers = []
    for index in range(2, 2 + rollouts):
        rollout = f"r{index}"
        run(api, task, rollout, start)
        answers.append(run(api, task, rollout, bash(f"{probe} # {rollout}"))["result"]["stdout"])
    return answers


def wait_for(predicate, timeout=60.0):
    """Until a worker's background work shows."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError("condition not reached in time")


@contextmanager
def worker_on(queues: list[str]) -> Iterator[None]:
    """A real worker thread consuming `queues` on the real Redis broker."""
    kept = _logging_state()
    try:
        with start_worker(
            celery_app, pool="threads", concurrency=2, queues=queues, perform_ping_check=False, shutdown_timeout=30
        ):
            yield
    finally:  # the worker sets up logging for its process; later tests' caplog needs it back
        _logging_restore(kept)


def _logging_state() -> dict:
    loggers = [logging.root, *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger))]
    return {logger: (logger.disabled, logger.propagate, logger.level, list(logger.handlers)) for logger in loggers}


def _logging_restore(kept: dict) -> None:
    for logger, (disabled, propagate, level, handlers) in kept.items():
        logger.disabled, logger.propagate, logger.level, logger.handlers = disabled, propagate, level, handlers
    for logger in logging.root.manager.loggerDict.values():
        if isinstance(logger, logging.Logger) and logger not in kept:
            logger.disabled = False
