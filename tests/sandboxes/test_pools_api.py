"""GET /api/v1/pools comes a page of tasks at a time, one row per task whatever its snapshots: a
training run has a task per prompt, each with up to its budget of live snapshots. Every page says
how many tasks there are in all; a bad page is a 400 with a stable code."""

from __future__ import annotations

import pytest

from tests.support.api import call, record

pytestmark = pytest.mark.django_db(transaction=True)

TASKS = 7
W = call("write", path="f", content="1")


def snapshot(api, task: str, node: int, ref: str, size: int) -> None:
    response = api.post(
        f"/api/v1/tasks/{task}/nodes/{node}/snapshots",
        {"ref": ref, "backend": "external", "size_bytes": size},
        format="json",
    )
    assert response.status_code == 201, response.content


@pytest.fixture
def tasks(api) -> list[str]:
    names = [f"pool-{i}" for i in range(TASKS)]
    for i, name in enumerate(names):
        env = {"backend": "external", "name": name}
        assert api.put(f"/api/v1/tasks/{name}", {"env": env, "sandbox_budget": 10}, format="json").status_code == 201
        history = []
        for depth in range(i % 3 + 1):  # 1 to 3 snapshots per task
            c = call("write", path=f"f{depth}", content=name)
            node = record(api, name, history, c, {"ok": True})["node_id"]
            snapshot(api, name, node, f"{name}-{depth}", 100)
            history.append(c)
    assert api.put("/api/v1/tasks/bare", {"env": {"backend": "external"}}, format="json").status_code == 201
    record(api, "bare", [], W, {"ok": True})  # no snapshot, no sandbox: not listed
    return names


def test_pools_come_a_page_of_tasks_at_a_time_with_one_row_each(api, tasks):
    seen, offset, pages = [], 0, 0
    while offset is not None:
        answer = api.get(f"/api/v1/pools?limit=3&offset={offset}").json()
        assert answer["count"] == TASKS and answer["totals"]["tasks"] == TASKS
        assert answer["totals"]["snapshots"] == sum(i % 3 + 1 for i in range(TASKS))  # of every task, on every page
        assert len(answer["tasks"]) <= 3
        seen += answer["tasks"]
        offset, pages = answer["next_offset"], pages + 1
    assert pages == 3
    assert [row["task_id"] for row in seen] == tasks  # in id order, each once, as the project names them
    assert [(row["snapshots"], row["bytes"], row["budget"]) for row in seen] == [
        (i % 3 + 1, 100 * (i % 3 + 1), 10) for i in range(TASKS)
    ]
    assert {"engine", "engines", "fork_latency_ms", "pools"} <= set(answer)


@pytest.mark.parametrize(
    "query", ["limit=0", "limit=501", "limit=ten", "offset=-1", "offset=1.5", "offset=99999999999"]
)
def test_a_bad_page_is_refused_with_a_stable_code(api, tasks, query):
    response = api.get(f"/api/v1/pools?{query}")
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "invalid_payload" and error["details"]["field"] == query.split("=")[0]


def test_a_page_past_the_end_is_empty_and_says_so(api, tasks):
    answer = api.get(f"/api/v1/pools?offset={TASKS}").json()
    assert (answer["tasks"], answer["count"], answer["next_offset"]) == ([], TASKS, None)
