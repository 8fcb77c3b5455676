"""Under the ASGI server the run command uses, a long miss never holds up other rollouts' hits."""

from __future__ import annotations

import threading

import httpx
import pytest
from django.conf import settings

from cache.api.auth import token_create
from cache.bench.server import service_running
from sandboxes.models import Sandbox

from .helpers import bash

pytestmark = pytest.mark.django_db(transaction=True)


def test_hits_are_answered_while_another_rollouts_long_miss_runs(busybox, docker_task):
    docker_task("busy")  # made here so that its sandboxes are removed afterwards; the server serves it
    token = token_create(name="asgi")
    headers = {"Authorization": f"Token {token}"}
    with service_running(db=settings.DATABASES["default"], redis_url=settings.REDIS_URL, workers=1) as service:
        base = service.url
        client = httpx.Client(base_url=base, headers=headers, timeout=120)

        def call(rollout: str, command: str) -> dict:
            response = client.post(f"/api/v1/tasks/busy/rollouts/{rollout}/calls", json={"call": bash(command)})
            assert response.status_code == 200, response.text
            return response.json()

        call("first", "echo cached")
        slow = threading.Thread(target=call, args=("slow", "sleep 20; echo done"))
        slow.start()
        while not Sandbox.objects.filter(rollout__rollout_id="slow", state="leased").exists():
            assert slow.is_alive()
            threading.Event().wait(0.1)
        hits = [call(f"quick-{i}", "echo cached") for i in range(5)]
        assert all(hit["cached"] for hit in hits)
        assert slow.is_alive()  # the 20 s miss is still running: the hits did not wait for it
        slow.join()
