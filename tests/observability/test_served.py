"""The service as deployed (uvicorn, two worker processes): /metrics adds up what both workers
counted (prometheus-client's multiprocess mode), the hot path echoes request ids, and the log
is JSON lines carrying them."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from django.db import connection

from lab.server import process_tree, service_running
from tests.support.api import call, record
from tests.support.metrics import Scrape

pytestmark = pytest.mark.django_db(transaction=True)

W = call("write", path="f", content="1")


def test_two_workers_counts_add_up_and_their_logs_are_json_with_request_ids(
    api, token, toy_task, tmp_path, monkeypatch
):
    record(api, toy_task, [], W, {"ok": True})  # before the variables below: this process counts elsewhere
    metrics_dir = tmp_path / "metrics"
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics_dir))
    monkeypatch.setenv("TVCACHE_METRICS_ALLOW", "not-a-network,127.0.0.1")  # each scrape logs a warning
    lookups = 24
    with service_running(db=connection.settings_dict, workers=2, log_dir=tmp_path) as service:
        for i in range(lookups):  # a connection each: the kernel spreads them over the workers
            answer = httpx.post(
                f"{service.url}/api/v1/tasks/{toy_task}/lookup",
                json={"history": [], "call": W},
                headers={"Authorization": f"Token {token}", "X-Request-ID": f"lookup-{i}"},
                timeout=10,
            )
            assert answer.status_code == 200 and answer.json()["hit"] is True
            assert answer.headers["X-Request-ID"] == f"lookup-{i}"
        # Each worker's ledger adds its lookups to the counter at its next flush (every 0.3 s; a
        # scrape flushes its own worker's at once): the sum is exact within that interval.
        deadline = time.monotonic() + 10
        while True:
            scraped = httpx.get(service.url + "/metrics", headers={"X-Request-ID": "scrape-1"}, timeout=10)
            assert scraped.status_code == 200 and scraped.headers["X-Request-ID"] == "scrape-1"
            counted = Scrape(scraped.text).value("tvcache_lookups_total", project="default", tool="write", result="hit")
            if counted >= lookups or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        workers = set(process_tree(service.pid)) - {service.pid}
        counting = {int(f.stem.rsplit("_", 1)[1]) for f in metrics_dir.glob("*.db")}
    # Each worker counts into the shared directory (as does `manage.py serve`, a Django process too).
    assert len(counting & workers) == 2 and len(counting) == 3
    metrics = Scrape(scraped.text)
    assert metrics.value("tvcache_lookups_total", project="default", tool="write", result="hit") == lookups
    assert metrics.value("tvcache_lookup_seconds_count") == lookups
    lines = [line for line in (tmp_path / "uvicorn.log").read_text().splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]  # every line is JSON
    assert {
        "request_id": "scrape-1",
        "logger": "tvcache.metrics",
        "level": "warning",
        "event": "TVCACHE_METRICS_ALLOW: 'not-a-network' is no address or network",
    }.items() <= events[-1].items()
