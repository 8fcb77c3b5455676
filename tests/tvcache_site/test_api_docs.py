"""/api/docs/ renders in headless Chromium with every request off this machine refused: Swagger UI's
files come from the service (drf-spectacular-sidecar, collectstatic, WhiteNoise), not a CDN.
The screenshot goes to artifacts/screenshots/api-docs.png."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest
from django.conf import settings
from django.db import connection
from playwright.sync_api import expect, sync_playwright

from lab.browser import chromium, collect_static
from lab.server import service_running

SHOTS = Path(settings.BASE_DIR) / "artifacts" / "screenshots"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@pytest.mark.browser
def test_api_docs_render_with_no_network(tmp_path):
    collect_static()
    SHOTS.mkdir(parents=True, exist_ok=True)
    with (
        service_running(db=connection.settings_dict, workers=1, log_dir=tmp_path) as service,
        sync_playwright() as playwright,
    ):
        browser = chromium(playwright)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        refused, errors, failed = [], [], []

        def loopback_only(route):
            url = route.request.url
            if urlsplit(url).scheme in ("http", "https", "ws", "wss") and urlsplit(url).hostname not in LOOPBACK:
                refused.append(url)
                route.abort("internetdisconnected")
            else:
                route.continue_()

        context.route("**/*", loopback_only)
        page = context.new_page()
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("requestfailed", lambda request: failed.append(request.url))
        page.goto(service.url + "/api/docs/")
        expect(page.locator(".swagger-ui .info .title")).to_contain_text("tvcache API")
        lookup = page.locator(".opblock", has_text="/api/v1/tasks/{task_id}/lookup")
        expect(lookup).to_have_count(1)
        assert page.locator(".opblock").count() >= 14  # every operation of the schema
        lookup.locator(".opblock-summary").click()  # expands: the operation's request body schema
        expect(lookup.locator(".opblock-body")).to_contain_text("history")
        page.screenshot(path=str(SHOTS / "api-docs.png"), full_page=False)
        browser.close()
    assert refused == [] and failed == [] and errors == []
