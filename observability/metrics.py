"""Prometheus metrics counted where the work happens (prometheus-client), exposed at /metrics by
`tvcache_site.metrics`.

The service runs several processes (uvicorn workers, a Celery worker that pre-forks sandboxes),
so prometheus-client's multiprocess mode is on by default: every process counts into its own
memory-mapped files under PROMETHEUS_MULTIPROC_DIR (settings: default `var/metrics`), and a
scrape adds them up. The variable must be set before prometheus_client is first imported; the
settings module does it. Files left by processes that are gone are deleted when a process next
imports this module (a restart starts the counts afresh, which Prometheus' rate() reads as a
counter reset); a live process's files stay.

Each function here is a few microseconds (a lock and a write to a memory-mapped file), never
touches the database and never raises into its caller: the hot paths call them per request.
"""

from __future__ import annotations

import bisect
import functools
import glob
import logging
import os
import threading
import time

from prometheus_client import Counter, Histogram, values

log = logging.getLogger("tvcache.metrics")

MULTIPROC_DIR = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")
PROJECT_DEFAULT = "default"  # tasks have no project yet: every series carries this one
MAX_TOOLS = 200  # distinct tool labels per process; more (a client inventing names) count as OTHER
OTHER = "_other"


def _prune_dead_processes(path: str) -> None:
    """Delete the files of processes that no longer run (`<kind>_<pid>.db`)."""
    for file in glob.glob(os.path.join(path, "*.db")):
        pid = os.path.basename(file)[:-3].rsplit("_", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.remove(file)
            except FileNotFoundError:  # another process pruned it first
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def process_id() -> int:
    """This process's id, without a system call per use (glibc no longer caches getpid, and the
    hot path asked for it three times a lookup): read at import and again after a fork."""
    return _pid


if MULTIPROC_DIR:
    if not getattr(values.ValueClass, "_multiprocess", False):
        raise RuntimeError(
            "PROMETHEUS_MULTIPROC_DIR was set after prometheus_client was imported: "
            "set it in the environment (or let tvcache_site.settings set it) first"
        )
    values.ValueClass = values.MultiProcessValue(process_identifier=process_id)
    os.makedirs(MULTIPROC_DIR, exist_ok=True)
    _prune_dead_processes(MULTIPROC_DIR)

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOOL_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
SANDBOX_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)

LOOKUPS = Counter(
    "tvcache_lookups",
    "Lookups answered (client mode and tool-server calls), by result: hit or miss.",
    ["project", "tool", "result"],
)
LOOKUP_SECONDS = Histogram(
    "tvcache_lookup_seconds",
    "Time to answer a client-mode lookup once its request is read (parse, statement, answer).",
    buckets=LATENCY_BUCKETS,
)
TOOL_CALL_SECONDS = Histogram(
    "tvcache_tool_call_seconds",
    "Tool-server calls: time to answer, from the cache (cached=true) or by executing.",
    ["tool", "cached"],
    buckets=TOOL_BUCKETS,
)
SANDBOX_START_SECONDS = Histogram(
    "tvcache_sandbox_start_seconds",
    "Time to start a sandbox: origin=snapshot is a fork, origin=root a fresh start; path=critical on a "
    "rollout's miss, path=pool ahead of it (pre-forks and warm roots).",
    ["backend", "origin", "path"],
    buckets=SANDBOX_BUCKETS,
)
SNAPSHOT_SECONDS = Histogram(
    "tvcache_snapshot_commit_seconds",
    "Time to snapshot a managed sandbox (docker commit, folder or database copy).",
    ["backend"],
    buckets=SANDBOX_BUCKETS,
)

_children: dict[tuple, object] = {}
_tools: set[str] = set()
_lock = threading.Lock()
_failed = False


def _child(metric, *labels: str):
    """The labelled child, cached (metric.labels() validates and locks on every call)."""
    key = (metric, labels)
    child = _children.get(key)
    if child is None:
        with _lock:
            child = _children[key] = metric.labels(*labels)
    return child


def _tool(tool: str) -> str:
    if tool in _tools:
        return tool
    with _lock:
        if len(_tools) < MAX_TOOLS:
            _tools.add(tool)
            return tool
    return OTHER


def _trouble() -> None:
    global _failed
    if not _failed:  # once per process: a broken metrics directory must not flood the log
        _failed = True
        log.exception("metrics: could not count (further failures are not logged)")


def lookups_counted(*, tool: str, hits: int, misses: int, project: str = PROJECT_DEFAULT) -> None:
    """Lookups answered, added up by the cache's ledger (off the hot path, every flush)."""
    try:
        for result, count in (("hit", hits), ("miss", misses)):
            if count:
                _child(LOOKUPS, project, _tool(tool), result).inc(count)
    except Exception:
        _trouble()


# Lookup durations noted on the hot path since the ledger's last flush (lookup_times_flush).
_lookup_seconds: list[float] = []
_lookup_lock = threading.Lock()


def lookup_times_flush() -> None:
    """Adds the lookup durations noted since the last call to LOOKUP_SECONDS, called by the cache's
    ledger at each flush (and before /metrics answers): one add per bucket, rather than two file
    writes per lookup on the hot path (multiprocess mode keeps each value in a file). What
    Histogram.observe does, for many amounts at once."""
    global _lookup_seconds
    with _lookup_lock:
        taken, _lookup_seconds = _lookup_seconds, []
    if not taken:
        return
    try:
        bounds = LOOKUP_SECONDS._upper_bounds  # ascending, +Inf last: an amount goes to the first bound >= it
        counts = [0] * len(bounds)
        for amount in taken:
            counts[bisect.bisect_left(bounds, amount)] += 1
        LOOKUP_SECONDS._sum.inc(sum(taken))
        for bucket, count in zip(LOOKUP_SECONDS._buckets, counts):
            if count:
                bucket.inc(count)
    except Exception:
        _trouble()


def lookup_timed(answer):
    """Decorates a lookup endpoint's answer function: its duration goes to LOOKUP_SECONDS (at the
    ledger's next flush), unless it answered None (not answered here: whatever answers it instead
    is timed)."""

    @functools.wraps(answer)
    def timed(**kwargs):
        started = time.perf_counter()
        answered = True  # an error answered too
        try:
            result = answer(**kwargs)
            answered = result is not None
            return result
        finally:
            if answered:
                with _lookup_lock:
                    _lookup_seconds.append(time.perf_counter() - started)

    return timed


def tool_call_observed(*, tool: str, cached: bool, ms: float) -> None:
    try:
        _child(TOOL_CALL_SECONDS, _tool(tool), "true" if cached else "false").observe(ms / 1000)
    except Exception:
        _trouble()


def sandbox_started(*, backend: str, forked: bool, path: str, ms: float | None) -> None:
    """A sandbox started: forked from a snapshot or fresh; on the critical path or for a pool."""
    try:
        if ms is not None:
            _child(SANDBOX_START_SECONDS, backend, "snapshot" if forked else "root", path).observe(ms / 1000)
    except Exception:
        _trouble()


def snapshot_committed(*, backend: str, ms: float) -> None:
    try:
        _child(SNAPSHOT_SECONDS, backend).observe(ms / 1000)
    except Exception:
        _trouble()
