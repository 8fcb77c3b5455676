"""/metrics: Prometheus text that prometheus_client's parser reads, counts that move with lookups,
gauges read from the database and Redis at scrape time, and the address allow-list."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
from django.apps import apps
from django.conf import settings as django_settings
from django.db import connection

from lab.server import database_url
from sandboxes.services import pool_request
from tests.support.api import call, lookup, record
from tests.support.metrics import Scrape, scrape
from tvcache_site.celery import app as celery_app

pytestmark = pytest.mark.django_db

W = call("write", path="f", content="1")
R = call("read", path="f")


def test_lookups_hits_and_misses_count_per_project_and_tool(api, toy_task):
    before = scrape(api)
    record(api, toy_task, [], W, {"ok": True})
    assert lookup(api, toy_task, [], W)["hit"] is True
    assert lookup(api, toy_task, [W], R)["hit"] is False
    assert lookup(api, toy_task, [W], R)["hit"] is False
    after = scrape(api)

    def delta(name: str, **labels) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    assert after.families["tvcache_lookups"].type == "counter"
    assert delta("tvcache_lookups_total", project="default", tool="write", result="hit") == 1
    assert delta("tvcache_lookups_total", project="default", tool="read", result="miss") == 2
    assert delta("tvcache_lookups_total", project="default", tool="write", result="miss") == 0
    assert after.families["tvcache_lookup_seconds"].type == "histogram"
    assert delta("tvcache_lookup_seconds_count") == 3
    assert delta("tvcache_lookup_seconds_sum") > 0
    assert delta("tvcache_lookup_seconds_bucket", le="+Inf") == 3


def test_live_snapshots_and_sandboxes_are_read_at_scrape_time(api, toy_task):
    assert scrape(api).value("tvcache_snapshots", backend="external", owner="client") == 0
    node_id = record(api, toy_task, [], W, {"ok": True})["node_id"]
    response = api.post(
        f"/api/v1/tasks/{toy_task}/nodes/{node_id}/snapshots",
        {"ref": "snap-1", "backend": "external", "size_bytes": 10, "create_ms": 5.0},
        format="json",
    )
    assert response.status_code == 201, response.content
    pool_request(task_id=toy_task, roots=2)
    scraped = scrape(api)
    assert scraped.families["tvcache_snapshots"].type == "gauge"
    assert scraped.value("tvcache_snapshots", backend="external", owner="client") == 1
    assert scraped.value("tvcache_sandboxes", backend="external", pool="root", state="warming") == 2


def test_divergences_are_a_counter_of_the_divergence_table(api):
    family = scrape(api).families["tvcache_divergences"]
    model = next((m for m in apps.get_models() if m.__name__ == "Divergence"), None)
    assert family.type == "counter"
    assert sum(sample.value for sample in family.samples) == (model.objects.count() if model else 0)


def test_queue_depth_counts_waiting_jobs_and_a_scrape_survives_redis_down(api, settings, monkeypatch):
    # A queue of this test's own: the session's is shared with the in-process workers and the jobs
    # of the tests before it, so its depth is not this test's to know.
    queue = f"{celery_app.conf.task_default_queue}-depth-{uuid.uuid4().hex[:8]}"
    monkeypatch.setitem(celery_app.conf, "task_default_queue", queue)
    assert scrape(api).value("tvcache_queue_depth", queue=queue) == 0
    with celery_app.connection_for_write() as broker:  # one connection: it deletes what it declared
        celery_app.send_task("workers.tasks.claims_clear", queue=queue, connection=broker)
        try:
            scraped = scrape(api)
            assert scraped.value("tvcache_broker_up") == 1
            assert scraped.value("tvcache_queue_depth", queue=queue) == 1
        finally:
            broker.default_channel.queue_purge(queue)
            broker.default_channel.queue_delete(queue)
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    down = scrape(api)
    assert down.value("tvcache_broker_up") == 0 and "tvcache_queue_depth" not in down.families
    assert "tvcache_lookups" in down.families or "tvcache_lookup_seconds" in down.families  # the rest is served


def test_metrics_are_refused_outside_the_allow_list(client, settings):
    refused = client.get("/metrics", REMOTE_ADDR="203.0.113.7")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    assert client.get("/metrics", REMOTE_ADDR="::1").status_code == 200
    settings.METRICS_ALLOW = ["10.0.0.0/8"]
    assert client.get("/metrics").status_code == 403  # loopback is no longer listed
    assert client.get("/metrics", REMOTE_ADDR="10.1.2.3").status_code == 200
    assert client.get("/metrics", REMOTE_ADDR="::ffff:10.1.2.3").status_code == 200
    not_allowed = client.post("/metrics", REMOTE_ADDR="10.1.2.3")
    assert not_allowed.status_code == 405 and not_allowed.json()["error"]["code"] == "method_not_allowed"


def test_without_a_multiprocess_directory_one_process_counts_in_memory(tmp_path):
    code = (
        "import django; django.setup(); from django.test import Client; "
        "import sys; sys.stdout.write(Client().get('/metrics').content.decode())"
    )
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": "",
        "DJANGO_SETTINGS_MODULE": "tvcache_site.settings",
        "DATABASE_URL": database_url(connection.settings_dict),
        "TVCACHE_VAR_DIR": str(tmp_path),
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=django_settings.BASE_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    scraped = Scrape(out)
    assert "tvcache_lookup_seconds" in scraped.families and "tvcache_sandboxes" in scraped.families
    assert "process_cpu_seconds" in scraped.families  # this process's own registry, not the files
    assert not (tmp_path / "metrics").exists()
