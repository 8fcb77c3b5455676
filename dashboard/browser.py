"""The ASGI app under uvicorn in a subprocess, and Debian's Chromium driven by Playwright against it:
shared by the browser tests and `manage.py bench_dashboard`. Playwright never downloads a browser
here: it launches /usr/bin/chromium (CHROMIUM_PATH to change it)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from django.conf import settings
from django.core.management import call_command

from cache.bench.server import answers, free_port, stop, wait_until

CHROMIUM_PATH = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
START_TIMEOUT_S = 30.0


def collect_static() -> None:
    """The server serves static files with WhiteNoise from STATIC_ROOT, as in production."""
    call_command("collectstatic", interactive=False, verbosity=0)


def database_url(db: dict) -> str:
    user = db.get("USER") or "postgres"
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    host = db.get("HOST") or "127.0.0.1"
    port = db.get("PORT") or 5432
    return f"postgres://{user}{password}@{host}:{port}/{db['NAME']}"


@contextlib.contextmanager
def uvicorn_server(*, db: dict, redis_url: str, log_path: Path | None = None) -> Iterator[str]:
    """Serve `tvcache_site.asgi:application` (HTTP and websockets) on a free loopback port; yields its base URL."""
    port = free_port()
    env = {**os.environ, "DATABASE_URL": database_url(db), "REDIS_URL": redis_url,
           "DJANGO_SETTINGS_MODULE": "tvcache_site.settings", "CONN_MAX_AGE": "0"}
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "tvcache_site.asgi:application", "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "warning"],
        cwd=settings.BASE_DIR, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers(base, "/login/"), START_TIMEOUT_S, f"uvicorn (log: {log_path})", [process])
        yield base
    finally:
        stop([process], timeout_s=10)
        if log_path:
            log.close()


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
