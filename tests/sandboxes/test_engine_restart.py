"""Docker engine restart: a served instance's docker tasks answer 503 engine_unavailable
while the engine is down, everything else keeps serving, and sandboxes come back: a rollout whose
container died with the engine gets sandbox_gone, then a fresh sandbox with its history replayed.

The engine restarted is a second dockerd that this test starts (tests/sandboxes/dockerd.py); the
machine's engine is never touched."""

from __future__ import annotations

import httpx
import pytest
from django.conf import settings

from lab.server import service_running

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.docker]


def test_an_engine_restart_answers_503_meanwhile_and_rollouts_get_fresh_sandboxes(second_engine, token, monkeypatch):
    monkeypatch.setenv("TVCACHE_DOCKER_URL", second_engine.url)
    with (
        service_running(db=settings.DATABASES["default"], workers=1) as service,
        httpx.Client(base_url=service.url, headers={"Authorization": f"Token {token}"}, timeout=120) as client,
    ):

        def call(rollout: str, command: str, task: str = "restart") -> httpx.Response:
            return client.post(
                f"/api/v1/tasks/{task}/rollouts/{rollout}/calls",
                json={"call": {"tool": "bash", "args": {"command": command}}},
            )

        def folder_call(rollout: str) -> httpx.Response:
            return client.post(
                f"/api/v1/tasks/folders/rollouts/{rollout}/calls",
                json={"call": {"tool": "write_file", "args": {"path": "a", "content": rollout}}},
            )

        assert client.put("/api/v1/tasks/restart", json={"env": {"backend": "docker"}}).status_code == 201
        assert client.put("/api/v1/tasks/folders", json={"env": {"backend": "directory"}}).status_code == 201
        assert call("r1", "echo 1 > /f").json()["cached"] is False
        assert call("r1", "cat /f").json()["result"]["stdout"] == "1\n"
        assert len(second_engine.client().containers.list()) == 1  # r1's sandbox, on the second engine

        second_engine.stop()
        down = call("r1", "echo 2 >> /f; cat /f")  # a miss in r1's sandbox: the engine is needed
        assert down.status_code == 503 and down.json()["error"]["code"] == "engine_unavailable", down.text
        assert down.headers["Retry-After"] == "1"
        fresh = call("r3", "echo 3 > /g")  # a miss that needs a new sandbox
        assert fresh.status_code == 503 and fresh.json()["error"]["code"] == "engine_unavailable", fresh.text
        created = client.put("/api/v1/tasks/another", json={"env": {"backend": "docker"}})
        assert created.status_code == 503 and created.json()["error"]["code"] == "engine_unavailable"
        # The rest keeps serving: hits need no sandbox, other backends no engine.
        hit = call("r2", "echo 1 > /f")
        assert hit.status_code == 200 and hit.json()["cached"] is True
        assert folder_call("f1").status_code == 200
        pools = client.get("/api/v1/pools")
        assert pools.status_code == 200 and pools.json()["engine"]["ok"] is False

        second_engine.start()  # r1's container died with the engine
        # r1's sandbox was retired when its engine failed (it may have been ahead of the history), or
        # its next call finds it gone (503 sandbox_gone, once): either way r1 goes on in a fresh
        # sandbox with its history replayed.
        back = call("r1", "echo 2 >> /f; cat /f")
        if back.status_code == 503:
            assert back.json()["error"]["code"] == "sandbox_gone", back.text
            back = call("r1", "echo 2 >> /f; cat /f")
        assert back.status_code == 200 and back.json()["result"]["stdout"] == "1\n2\n", back.text
        other = call("r2", "echo 4 >> /f; cat /f")  # r2 had no sandbox: it gets one
        assert other.status_code == 200 and other.json()["result"]["stdout"] == "1\n4\n", other.text
        assert call("r3", "echo 3 > /g; cat /g").json()["result"]["stdout"] == "3\n"
        created = client.put("/api/v1/tasks/another", json={"env": {"backend": "docker"}})
        assert created.status_code == 201, created.text
        for rollout in ("r1", "r2", "r3"):
            assert client.delete(f"/api/v1/tasks/restart/rollouts/{rollout}").status_code == 204
