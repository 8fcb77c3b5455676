"""GET /metrics: Prometheus text format, without a token, from TVCACHE_METRICS_ALLOW only.

Two kinds of series. Counted as the service works, by every process (`observability.metrics`:
lookups, latencies, fork and commit times), added up here from the multiprocess files. Read at
scrape time, here (the top layer, which may read every app): live sandboxes and snapshots,
divergences, the Celery queue's depth and workers. A scrape costs a few aggregate queries and one Redis round
trip; the hot paths never pay for metrics with a statement.
"""

from __future__ import annotations

import ipaddress
import logging

from django.conf import settings
from django.db.models import Count
from django.http import HttpResponse
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from cache.ledger import ledger_flush
from cache.models import Divergence, Snapshot
from core.api.errors import error_response
from core.background import backlog
from core.errors import Forbidden, MethodNotAllowed
from observability import metrics
from sandboxes.models import Sandbox

log = logging.getLogger("tvcache.metrics")


def address_allowed(address: str, allow: list[str]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for entry in allow:
        try:
            if ip in ipaddress.ip_network(entry.strip(), strict=False):
                return True
        except ValueError:
            log.warning("TVCACHE_METRICS_ALLOW: %r is no address or network", entry)
    return False


def metrics_view(request):
    if request.method not in ("GET", "HEAD"):
        response = error_response(MethodNotAllowed(f"Method {request.method} not allowed: GET /metrics."))
        response["Allow"] = "GET, HEAD"
        return response
    if not address_allowed(request.META.get("REMOTE_ADDR", ""), settings.METRICS_ALLOW):
        return error_response(
            Forbidden("Metrics are readable from TVCACHE_METRICS_ALLOW's addresses only.", code="permission_denied")
        )
    ledger_flush(write=False)  # the lookups this process counted since the ledger's last flush
    return HttpResponse(_exposition(), content_type=CONTENT_TYPE_PLAIN_0_0_4)


def _exposition() -> bytes:
    registry = CollectorRegistry()
    if metrics.MULTIPROC_DIR:
        MultiProcessCollector(registry, path=metrics.MULTIPROC_DIR)
    else:
        registry.register(_ThisProcess())
    registry.register(_ServiceState())
    try:
        return generate_latest(registry)
    except FileNotFoundError:  # a process pruned a dead one's file between listing and reading
        return generate_latest(registry)


class _ThisProcess:
    """Single-process mode: what this process counted (and its process and GC series)."""

    def collect(self):
        return REGISTRY.collect()


class _ServiceState:
    """Series read at scrape time."""

    def collect(self):
        yield _sandboxes()
        yield _snapshots()
        yield _divergences()
        yield from _queues()


def _sandboxes() -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "tvcache_sandboxes",
        "Managed sandboxes that are not stopped, by pool and state.",
        labels=["backend", "pool", "state"],
    )
    rows = (
        Sandbox.objects.exclude(state__in=[Sandbox.State.STOPPED, Sandbox.State.FAILED])
        .values("backend", "pool", "state")
        .annotate(n=Count("id"))
        .order_by()
    )
    for row in rows:
        family.add_metric([row["backend"], row["pool"], row["state"]], row["n"])
    return family


def _snapshots() -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "tvcache_snapshots", "Live snapshots, by backend and owner (client or service).", labels=["backend", "owner"]
    )
    rows = (
        Snapshot.objects.filter(status=Snapshot.Status.LIVE)
        .values("backend", "owner")
        .annotate(n=Count("id"))
        .order_by()
    )
    for row in rows:
        family.add_metric([row["backend"], row["owner"]], row["n"])
    return family


def _divergences() -> CounterMetricFamily:
    """Divergent results found (verification of materialized sandboxes, the determinism audit), per tool."""
    family = CounterMetricFamily(
        "tvcache_divergences", "Divergences found (a result that did not repeat).", labels=["tool"]
    )
    for row in Divergence.objects.values("tool").annotate(n=Count("pk")).order_by():
        family.add_metric([row["tool"]], row["n"])
    return family


def _queues():
    """The broker's reachability, the jobs waiting in the Celery queue, the workers alive to take
    them (core.background.backlog) and whether jobs wait with none: nothing when embedded."""
    found = backlog()
    if found is None:  # embedded mode: background work runs in process, there is no queue
        return
    up = GaugeMetricFamily("tvcache_broker_up", "1 if the Celery broker (Redis) answered this scrape.")
    up.add_metric([], int(found.broker_up))
    yield up
    if not found.broker_up:
        return
    depth = GaugeMetricFamily("tvcache_queue_depth", "Celery jobs waiting in the queue (Redis).", labels=["queue"])
    depth.add_metric([found.queue], found.waiting)
    yield depth
    workers = GaugeMetricFamily(
        "tvcache_workers", "Celery workers of the queue alive in the last 30 s (heartbeats).", labels=["queue"]
    )
    workers.add_metric([found.queue], found.workers)
    yield workers
    stalled = GaugeMetricFamily(
        "tvcache_background_stalled", "1 while jobs wait in the queue and no worker is alive to take them."
    )
    stalled.add_metric([], int(found.stalled))
    yield stalled
