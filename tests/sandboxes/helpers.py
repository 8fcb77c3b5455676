"""Calls for the tool-server tests."""


def bash(command: str, **args) -> dict:
    return {"tool": "bash", "args": {"command": command, **args}}


def run(api, task_id: str, rollout_id: str, call: dict, status: int = 200) -> dict:
    response = api.post(f"/api/v1/tasks/{task_id}/rollouts/{rollout_id}/calls", {"call": call}, format="json")
    assert response.status_code == status, response.content
    return response.json()
