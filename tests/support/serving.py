"""`manage.py serve` started as a deployment would run it, against the test database."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from django.conf import settings

from accounts.services.tokens import token_create
from lab.server import ROOT, _queue_delete, answers, database_url, free_port, wait_until


@contextmanager
def serving(*options: str) -> Iterator[tuple[subprocess.Popen, str, httpx.Client]]:
    """The command (with `options`) on a free port, its URL and a client with a token; killed
    afterwards if the test did not stop it, its Celery queue deleted."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tvcache_site.settings",
        "DEBUG": "0",
        "DATABASE_URL": database_url(settings.DATABASES["default"]),
        "REDIS_URL": settings.REDIS_URL,
        "CELERY_QUEUE": f"tvcache-serve-{uuid.uuid4().hex[:8]}",
    }
    serve = subprocess.Popen(
        [sys.executable, "manage.py", "serve", *options, "--port", str(port), "--workers", "1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: answers(url), 60, "the service", [serve])
        token = token_create(name="serve")
        yield serve, url, httpx.Client(base_url=url, headers={"Authorization": f"Token {token}"}, timeout=120)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        _queue_delete(settings.REDIS_URL, env["CELERY_QUEUE"])
