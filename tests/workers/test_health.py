"""Health (GET /healthz, /readyz), and no silent degradation: a broker whose jobs no worker takes
is said so by /readyz, /metrics and a banner on every dashboard page; a worker's heartbeat clears it."""

from __future__ import annotations

import uuid

import httpx
import pytest
import redis
from celery import current_app
from django.conf import settings

from cache.models import Task
from dashboard import context
from lab.server import service_running
from tests.dashboard import conftest as dashboard
from tests.support.api import wait_for

pytestmark = pytest.mark.django_db(transaction=True)
staff_user, staff_client = dashboard.staff_user, dashboard.staff_client  # the dashboard's fixtures


@pytest.fixture
def queued_job():
    """A job waiting in a default queue of this test's own, which no worker consumes (a worker
    another test of this process started may consume the session's)."""
    broker = redis.Redis.from_url(settings.REDIS_URL)
    queue = f"tvcache-health-{uuid.uuid4().hex[:8]}"
    conf = current_app.conf  # the app background jobs go through (core.background), whichever is current
    default, conf.task_default_queue = conf.task_default_queue, queue
    broker.lpush(queue, b'{"body": "a job nobody takes"}')
    context._backlog.clear()
    try:
        yield queue
    finally:
        conf.task_default_queue = default
        broker.delete(queue)
        context._backlog.clear()


def test_liveness_and_readiness_answer_without_a_token(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    checks = ready.json()["checks"]
    assert checks["database"]["ok"] is True and checks["background"]["broker_up"] is True
    assert "engines" in checks


def test_jobs_waiting_with_no_worker_are_said_everywhere(client, staff_client, queued_job):
    ready = client.get("/readyz").json()
    assert ready["status"] == "degraded"
    background = ready["checks"]["background"]
    assert (background["ok"], background["queue_depth"], background["workers"]) == (False, 1, 0)
    assert "no worker takes them" in background["detail"]
    metrics = client.get("/metrics", REMOTE_ADDR="127.0.0.1").content.decode()
    assert "tvcache_background_stalled 1.0" in metrics
    assert f'tvcache_workers{{queue="{queued_job}"}} 0.0' in metrics
    page = staff_client.get("/").content.decode()
    assert 'data-banner="background"' in page and f"queue {queued_job}" in page


def test_embedded_mode_has_no_queue_to_wait_on(client, settings, staff_client):
    settings.REDIS_URL = ""
    context._backlog.clear()
    background = client.get("/readyz").json()["checks"]["background"]
    assert (background["ok"], background["mode"]) == (True, "embedded")
    assert 'data-banner="background"' not in staff_client.get("/").content.decode()
    context._backlog.clear()


def test_a_running_worker_is_seen_by_its_heartbeat(token):
    with service_running(db=settings.DATABASES["default"], workers=1, celery=True) as service:
        with httpx.Client(base_url=service.url, timeout=10) as http:
            wait_for(lambda: http.get("/readyz").json()["checks"]["background"]["workers"] >= 1, 30, "a heartbeat")
            ready = http.get("/readyz").json()
            assert ready["checks"]["background"]["ok"] is True
            assert Task.objects.count() == 0  # (nothing needed making for it)
    with service_running(db=settings.DATABASES["default"], workers=1) as service:  # the same broker, no worker
        background = httpx.get(f"{service.url}/readyz", timeout=10).json()["checks"]["background"]
        assert (background["ok"], background["workers"]) == (False, 0)
