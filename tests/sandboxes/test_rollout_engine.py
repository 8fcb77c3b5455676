"""One rollout engine: tool-server mode and the verl-tool proxy serve the same cases through the
same protocol (cache/tcg/rollout.py), step for step. Each mode logs the acts each call took; the
cases must take the same acts in both, and answer what the tool answers."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from cache.models import Claim
from tests.support.toolserver import bash, run
from tests.support.upstreams import interact, register
from tests.upstreams.verl_tool_server import verl_tool_server

pytestmark = pytest.mark.django_db(transaction=True)

BASH = r"<bash>(.*?)</bash>"
FAILS = object()  # a call whose effects are unknown: a timeout in a sandbox, a tool failing upstream


class ToolServer:
    def __init__(self, api, docker_task):
        self.api, self.tasks = api, {name: docker_task(f"engine-{name}") for name in ("t1", "t2")}

    def call(self, task: str, rollout: str, command) -> str:
        call = bash("sleep 30", timeout_s=1) if command is FAILS else bash(command)
        return run(self.api, self.tasks[task], rollout, call)["result"]["stdout"]


class Proxy:
    def __init__(self, url: str):
        self.url = url

    def call(self, task: str, rollout: str, command) -> str:
        action = "<bash>crash</bash>" if command is FAILS else f"<bash>{command}</bash>"
        observation = interact(self.url, rollout, action, {"task_id": task})[0]["obs"]
        return observation.split("<reminder>")[0]  # the tool's reminder of the turns left


@pytest.fixture(params=["toolserver", "proxy"])
def mode(request, api, live_server):
    if request.param == "toolserver":
        yield ToolServer(api, request.getfixturevalue("docker_task"))
        return
    with verl_tool_server() as upstream:
        yield Proxy(
            live_server.url
            + register(api, "engine", url=upstream.url, task_fields=["task_id"], action_pattern=BASH)["proxy_path"]
        )


def traces(caplog) -> dict[str, list[str]]:
    """The acts of each rollout's calls, in order."""
    taken: dict[str, list[str]] = {}
    for record in caplog.records:
        if record.name == "tvcache.rollout":
            rollout, acts = record.getMessage().removeprefix("rollout ").split(": ", 1)
            taken.setdefault(rollout, []).append(acts)
    return taken


def test_both_modes_take_the_same_steps_for_the_same_cases(mode, caplog):
    caplog.set_level(logging.DEBUG, logger="tvcache.rollout")
    # A miss, then the same calls by another rollout: hits.
    assert mode.call("t1", "r1", "echo one > f").strip() == ""
    assert mode.call("t1", "r1", "cat f").startswith("one")
    mode.call("t1", "r2", "echo one > f")
    assert mode.call("t1", "r2", "cat f").startswith("one")
    # A miss after hits: its environment catches up first.
    assert mode.call("t1", "r2", "echo two >> f; cat f").startswith("one\ntwo\n")
    # Effects unknown: the rollout leaves the shared graph, and its next call runs as it is.
    mode.call("t1", "r3", "echo one > f")
    mode.call("t1", "r3", FAILS)
    assert mode.call("t1", "r3", "echo one > f").strip() == ""
    # Single flight: two rollouts miss the same call in the same state at once; one runs it.
    slow = "sleep 1; echo slow > s; cat s"
    leader = threading.Thread(target=mode.call, args=("t2", "r4", slow))
    leader.start()
    deadline = time.monotonic() + 30
    while not Claim.objects.filter(holder="r4").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mode.call("t2", "r5", slow).startswith("slow")
    leader.join()

    executed = "lookup > lead > execute > record > done"
    assert traces(caplog) == {
        "r1": [executed, executed],
        "r2": ["lookup > serve", "lookup > serve", executed],
        "r3": ["lookup > serve", "lookup > lead > execute > detach", "run_as_is"],
        "r4": [executed],
        "r5": ["lookup > lead > await > lookup > serve"],
    }
