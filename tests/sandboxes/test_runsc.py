"""Tool-server mode under gVisor (runsc): processes an agent leaves running survive forks.

A rollout starts something that keeps running (a background process, a daemonized web server, a
web server in the background) and the graph snapshots the state after that call. Later rollouts
hit the call and miss on a probe of their own: their sandbox is a fork of that snapshot, and it
answers what the live rollout's own sandbox answers, because the snapshot is a checkpoint that
holds the processes and their memory (sandboxes/backends/docker/checkpoint.py).
"""

from __future__ import annotations

import pytest

from cache.models import Snapshot
from sandboxes.images import DEBIAN_TAG
from sandboxes.models import Sandbox
from tests.support.toolserver import BACKGROUND, DAEMON, HTTP, WRITER, answers_of_later_rollouts, bash, run

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

RUNSC = {"backend": "docker", "runtime": "runsc"}


def _forked_probes(api, task: str, first: dict, probe: str, rollouts: int = 3) -> list[str]:
    """What rollouts that hit `first` and miss on their own variant of `probe` get, from forks."""
    answers = []
    for i in range(rollouts):
        rollout = f"fork-{i}"
        assert run(api, task, rollout, first)["cached"] is True
        answer = run(api, task, rollout, bash(f"echo {rollout}; {probe}"))
        assert answer["cached"] is False
        assert Sandbox.objects.get(rollout__rollout_id=rollout, state="leased").pool == "fork"
        answers.append(answer["result"]["stdout"].removeprefix(f"{rollout}\n"))
    return answers


@pytest.mark.parametrize("case", [BACKGROUND, DAEMON, WRITER, HTTP], ids=["background", "daemon", "writer", "http"])
def test_every_rollout_answers_as_a_live_one_under_runsc(api, docker_task, snapshot_every_call, case):
    """The cases runc's tests run (test_processes.py), under gVisor: a state with live processes is
    forked from a checkpoint that holds them; a writer loop's state keeps changing, so it is kept
    off shared keys and run live. Either way each rollout gets the live rollout's answer."""
    first, probe, live = case
    image = {"image": DEBIAN_TAG} if case is HTTP else {}
    task = docker_task("runsc-live", env={**RUNSC, **image})
    start = bash(first)
    assert run(api, task, "r1", start)["result"]["stdout"] == "started\n"
    assert run(api, task, "r1", bash(probe))["result"]["stdout"] == live
    assert answers_of_later_rollouts(api, task, start, probe) == [live] * 3


def test_a_background_process_is_alive_in_forks_of_the_state_that_started_it(api, docker_task, snapshot_every_call):
    task = docker_task("runsc-background", env=RUNSC)
    first = bash("sleep 300 >/dev/null 2>&1 & echo $! > /pid; echo started")
    probe = "kill -0 $(cat /pid) && echo alive || echo gone"
    assert run(api, task, "live", first)["result"]["stdout"] == "started\n"
    live = run(api, task, "live", bash(probe))["result"]["stdout"]
    assert live == "alive\n"
    assert _forked_probes(api, task, first, probe) == [live] * 3


def test_servers_answer_in_forks_as_they_do_live(api, docker_task, snapshot_every_call):
    task = docker_task("runsc-servers", env=RUNSC)
    # A daemonized server (httpd forks into the background by itself) and one a shell put there.
    first = bash(
        "mkdir -p /www && echo page > /www/x && busybox httpd -p 8089 -h /www && "
        "(busybox httpd -f -p 8090 -h /www >/dev/null 2>&1 &) && echo started"
    )
    probe = (
        "wget -qO- http://127.0.0.1:8089/x || echo unreachable; wget -qO- http://127.0.0.1:8090/x || echo unreachable"
    )
    run(api, task, "live", first)
    live = run(api, task, "live", bash(probe))["result"]["stdout"]
    assert live == "page\npage\n"
    assert _forked_probes(api, task, first, probe) == [live] * 3


def test_the_source_sandbox_goes_on_after_its_snapshot(api, docker_task, snapshot_every_call):
    task = docker_task("runsc-source", env=RUNSC)
    # A counter that lives in its process's memory, written out only when asked.
    run(
        api,
        task,
        "live",
        bash(
            "(i=0; while true; do i=$((i+1)); if [ -e /poke ]; then echo $i > /count; rm /poke; fi; "
            "sleep 0.05; done) >/dev/null 2>&1 & echo started"
        ),
    )
    assert Snapshot.objects.get(task_id=task).keeps_processes  # taken: the sandbox was checkpointed and restored
    count = run(
        api,
        task,
        "live",
        bash(
            "touch /poke; for i in $(seq 100); do [ -e /count ] && break; sleep 0.05; done; "
            "cat /count 2>/dev/null || echo 0"
        ),
    )
    assert int(count["result"]["stdout"]) > 1  # it counts on from where the checkpoint stopped it


def test_an_env_that_asks_for_processes_to_survive_gets_runsc_or_a_clear_4xx(api, docker_task):
    kept = api.put("/api/v1/tasks/keep", {"env": {"backend": "docker", "keep_processes": True}}, format="json")
    assert kept.status_code in (200, 201), kept.content
    refused = api.put(
        "/api/v1/tasks/keep-runc",
        {"env": {"backend": "docker", "runtime": "runc", "keep_processes": True}},
        format="json",
    )
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "processes_not_kept"
    unknown = api.put("/api/v1/tasks/kata", {"env": {"backend": "docker", "runtime": "kata"}}, format="json")
    assert unknown.status_code == 403 and unknown.json()["error"]["code"] == "runtime_not_granted"
