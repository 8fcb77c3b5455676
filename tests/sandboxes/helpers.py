"""Calls for the tool-server tests."""

import time


def bash(command: str, **args) -> dict:
    return {"tool": "bash", "args": {"command": command, **args}}


def run(api, task_id: str, rollout_id: str, call: dict, status: int = 200) -> dict:
    response = api.post(f"/api/v1/tasks/{task_id}/rollouts/{rollout_id}/calls", {"call": call}, format="json")
    assert response.status_code == status, response.content
    return response.json()


def wait_for(predicate, timeout=60.0):
    """Until a worker's background work shows."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError("condition not reached in time")
