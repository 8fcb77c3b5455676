"""The run command's web-only mode (`manage.py serve --web-only`): the web processes of a larger
deployment, and what the lab's launcher serves tvcache with."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from lab.server import process_tree
from sandboxes.models import Sandbox
from sandboxes.services import sandboxes_release
from tests.support.serving import serving

pytestmark = pytest.mark.django_db(transaction=True)


def test_web_only_starts_no_worker_and_leaves_the_sandboxes_when_stopped():
    # Even with Redis: the deployment's workers and its sandboxes are run (and stopped) elsewhere.
    with serving("--web-only") as (serve, url, client):
        assert client.put("/api/v1/tasks/folders", json={"env": {"backend": "directory"}}).status_code == 201
        write = {"tool": "write_file", "args": {"path": "a", "content": "1"}}
        assert client.post("/api/v1/tasks/folders/rollouts/r1/calls", json={"call": write}).status_code == 200
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in process_tree(serve.pid)]
        assert not [command for command in commands if b"celery" in command]
        serve.send_signal(signal.SIGTERM)
        out, _ = serve.communicate(timeout=60)
    assert serve.returncode == 0 and out == "", out
    assert Sandbox.objects.filter(task_id="folders", state="leased").count() == 1
    assert sandboxes_release()["sandboxes"] == 1
