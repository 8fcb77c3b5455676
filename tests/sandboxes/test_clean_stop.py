"""Clean stop: stopping the run command (`manage.py serve`, what .ci/demo.sh runs) stops
what it started, and no sandbox of the service outlives it, not even one running a call."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx
import pytest

from lab.server import answers, process_tree, wait_until
from sandboxes.handles import backend_named, labels
from sandboxes.models import Sandbox
from tests.support.serving import serving
from tests.support.toolserver import bash

pytestmark = pytest.mark.django_db(transaction=True)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_stopping_the_run_command_stops_its_processes_and_sandboxes(busybox, docker_task):
    task = docker_task("clean-stop")
    with serving("--grace", "5") as (serve, url, client):

        def call(rollout: str, command: str):
            try:
                return client.post(f"/api/v1/tasks/{task}/rollouts/{rollout}/calls", json={"call": bash(command)})
            except httpx.TransportError as exc:  # cut off by the stop
                return exc

        assert call("idle", "echo 1 > /f").status_code == 200
        running = threading.Thread(target=call, args=("busy", "sleep 120"))
        running.start()
        wait_until(lambda: Sandbox.objects.filter(task_id=task, state="leased").count() == 2, 60, "two sandboxes")
        # uvicorn (one process with --workers 1), Celery and the two processes of its pool: Celery
        # forks its pool while it starts, which may be after the calls above on a busy machine.
        wait_until(lambda: len(process_tree(serve.pid)) - 1 >= 4, 60, "the command's processes", [serve])
        processes = [pid for pid in process_tree(serve.pid) if pid != serve.pid]
        serve.send_signal(signal.SIGTERM)
        out, _ = serve.communicate(timeout=120)
        running.join(timeout=60)
    assert serve.returncode == 0 and "2 sandboxes" in out, out
    assert not [pid for pid in processes if alive(pid)]
    assert not answers(url)
    assert backend_named("docker").list_sandboxes(labels(task)) == []  # no container left, running or not
    assert set(Sandbox.objects.filter(task_id=task).values_list("state", flat=True)) == {"stopped"}
