"""Debian's Chromium driven by Playwright against a served tvcache (`lab.server`): shared
by the browser tests and `manage.py bench_dashboard`. Playwright never downloads a browser here:
it launches /usr/bin/chromium (CHROMIUM_PATH to change it)."""

from __future__ import annotations

import os
from pathlib import Path

from django.core.management import call_command

CHROMIUM_PATH = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def collect_static() -> None:
    """The server serves static files with WhiteNoise from STATIC_ROOT, as in production."""
    call_command("collectstatic", interactive=False, verbosity=0)


def chromium(playwright):
    """Debian's Chromium; a missing one is an error, never a skip."""
    if not Path(CHROMIUM_PATH).exists():
        raise RuntimeError(f"Chromium not found at {CHROMIUM_PATH} (apt-get install chromium)")
    return playwright.chromium.launch(executable_path=CHROMIUM_PATH, headless=True, args=CHROMIUM_ARGS)


def log_in(page, base: str, username: str, password: str) -> None:
    page.goto(base + "/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button[type=submit]")
    page.wait_for_url(lambda url: "/login/" not in url)
