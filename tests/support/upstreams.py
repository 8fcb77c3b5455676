"""A verl-tool trainer's requests, exactly as its agent loop sends them
(verl_tool/agent_loop/verltool_agent_loop.py: interact_with_tool_server, close_traj_tool_threads),
and the registration of upstreams."""

from __future__ import annotations

import httpx


def post(url: str, body: dict) -> dict:
    response = httpx.post(url, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def interact(
    url: str, trajectory_id: str, action: str, extra_fields: dict | None = None, *, is_last_step: bool = False
) -> tuple:
    """One action of one trajectory: (observation, done, valid)."""
    body = {"trajectory_ids": [trajectory_id], "actions": [action], "finish": [False], "is_last_step": [is_last_step]}
    if extra_fields is not None:
        body["extra_fields"] = [extra_fields]
    answer = post(url, body)
    return answer["observations"][0], answer["dones"][0], answer["valids"][0]


def close(url: str, trajectory_id: str) -> dict:
    """The end of a trajectory: finish, no extra fields, the last step."""
    return post(url, {"trajectory_ids": [trajectory_id], "actions": [""], "finish": [True], "is_last_step": [True]})


def batch(url: str, trajectory_ids: list[str], actions: list[str], extra_fields: list[dict]) -> list[tuple]:
    answer = post(
        url,
        {
            "trajectory_ids": trajectory_ids,
            "actions": actions,
            "extra_fields": extra_fields,
            "finish": [False] * len(actions),
            "is_last_step": [False] * len(actions),
        },
    )
    return list(zip(answer["observations"], answer["dones"], answer["valids"]))


def run(url: str, trajectory_id: str, steps: list[tuple[str, dict]]) -> list[tuple]:
    """A whole trajectory: its actions one by one, then its finish."""
    answers = [interact(url, trajectory_id, action, extra) for action, extra in steps]
    close(url, trajectory_id)
    return answers


def register(api, name: str, **config) -> dict:
    response = api.put(f"/api/v1/upstreams/{name}", {"protocol": "verl-tool", **config}, format="json")
    assert response.status_code in (200, 201), response.content
    return response.json()


def stats(api, name: str) -> dict:
    response = api.get(f"/api/v1/upstreams/{name}")
    assert response.status_code == 200, response.content
    return response.json()
