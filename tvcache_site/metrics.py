"""GET /metrics: Prometheus text format, without a token, from TVCACHE_METRICS_ALLOW only.

Two kinds of series. Counted as the service works, by every process (`observability.metrics`:
lookups, latencies, fork and commit times), added up here from the multiprocess files. Read at
scrape time, here (the top layer, which may read every app): live sandboxes and snapshots,
divergences, the Celery queue's depth. A scrape costs a few aggregate queries and one Redis round
trip; the hot paths never pay for metrics with a statement.
"""

from __future__ import annotations

import ipaddress
import logging

import redis
from django.conf import settings
from django.db.models import Count
from django.http import HttpResponse
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from cache.models import Divergence, Snapshot
from core.api.errors import error_response
from core.errors import Forbidden, MethodNotAllowed
from observability import metrics
from sandboxes.models import Sandbox
from tvcache_site.celery import app

log = logging.getLogger("tvcache.metrics")

REDIS_TIMEOUT_S = 0.5
# kombu's Redis transport keeps a queue as one list per priority step: "<queue>", then
# "<queue>\x06\x16<step>" for steps 3, 6 and 9 (its default priority_steps).
KOMBU_PRIORITY_SUFFIXES = ("", "\x06\x163", "\x06\x166", "\x06\x169")
_redis_clients: dict[str, redis.Redis] = {}


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
    """Messages waiting in the Celery queue; the broker's reachability. Redis down: up 0, no depth."""
    url = settings.REDIS_URL
    if not url:  # embedded mode: background work runs in process, there is no queue
        return
    queue = app.conf.task_default_queue
    up = GaugeMetricFamily("tvcache_broker_up", "1 if the Celery broker (Redis) answered this scrape.")
    try:
        client = _redis_clients.get(url) or _redis_clients.setdefault(
            url, redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
        )
        with client.pipeline(transaction=False) as pipe:
            for suffix in KOMBU_PRIORITY_SUFFIXES:
                pipe.llen(queue + suffix)
            depth = sum(pipe.execute())
    except redis.RedisError as exc:
        log.warning("metrics: the broker did not answer: %s", exc)
        up.add_metric([], 0)
        yield up
        return
    up.add_metric([], 1)
    yield up
    family = GaugeMetricFamily("tvcache_queue_depth", "Celery jobs waiting in the queue (Redis).", labels=["queue"])
    family.add_metric([queue], depth)
    yield family
