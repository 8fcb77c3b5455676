"""JSON log lines with request ids: every response carries X-Request-ID (the client's when it is
a sane token), and what a request logs carries the same id."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re

import pytest
from django.test import AsyncClient

from observability.logs import json_formatter


@pytest.fixture
def log_lines():
    """What the service's loggers write, through the formatter the settings give their handler."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(json_formatter())
    logger = logging.getLogger("tvcache")
    logger.addHandler(handler)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    logger.removeHandler(handler)


@pytest.mark.django_db
def test_a_request_echoes_its_id_and_its_log_lines_carry_it(client, settings, log_lines):
    settings.METRICS_ALLOW = ["bogus", "127.0.0.1"]  # the scrape logs a warning about the bad entry
    response = client.get("/metrics", HTTP_X_REQUEST_ID="req-42")
    assert response.status_code == 200 and response["X-Request-ID"] == "req-42"
    [line] = log_lines()
    assert line["request_id"] == "req-42" and line["logger"] == "tvcache.metrics" and line["level"] == "warning"
    assert line["event"] == "TVCACHE_METRICS_ALLOW: 'bogus' is no address or network"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+Z", line["timestamp"])


@pytest.mark.django_db
def test_a_request_without_a_sane_id_gets_a_new_one(client):
    made = set()
    for incoming in (None, "two words", "x" * 200, "line\nbreak"):
        extra = {} if incoming is None else {"HTTP_X_REQUEST_ID": incoming}
        rid = client.get("/api/schema/", **extra)["X-Request-ID"]
        assert re.fullmatch(r"[0-9a-f]{32}", rid)
        made.add(rid)
    assert len(made) == 4
    assert client.get("/no/such/page", HTTP_X_REQUEST_ID="r-404")["X-Request-ID"] == "r-404"  # errors too


def test_the_async_handler_echoes_it_too():
    response = asyncio.run(AsyncClient().get("/api/schema/", headers={"X-Request-ID": "async-1"}))
    assert response.status_code == 200 and response["X-Request-ID"] == "async-1"


def test_existing_log_calls_become_json_lines(log_lines):
    log = logging.getLogger("tvcache.example")
    log.warning("snapshot of sandbox %s failed: %s", "abc", "engine down")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("flush failed")
    warning, error = log_lines()
    assert warning["event"] == "snapshot of sandbox abc failed: engine down" and "request_id" not in warning
    assert error["level"] == "error" and "RuntimeError: boom" in error["exception"]
