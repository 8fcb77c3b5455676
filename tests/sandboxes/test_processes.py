"""Processes are state (docs/design/state.md): a server, a daemon, a background job or a writer loop
that a call leaves running is part of the state later calls see. Tool-server mode, the real Docker
engine (runc): a filesystem snapshot never stands in for such a state, so every rollout gets the
answer a live rollout of the same history gets. And tvcache's own bookkeeping is out of the agent's
reach: what the agent does to any path changes nothing a plain container would not."""

from __future__ import annotations

import time

import docker
import pytest

from cache.ledger import ledger_flush
from cache.models import Divergence, MaterializationStat, Node, Rollout, Snapshot
from sandboxes.images import DEBIAN_TAG
from tests.support.toolserver import BACKGROUND, DAEMON, HTTP, WRITER, answers_of_later_rollouts, bash, run

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("case", [BACKGROUND, DAEMON, WRITER], ids=["background", "daemon", "writer"])
def test_a_state_with_live_processes_is_never_forked_from_its_files(api, docker_task, snapshot_every_call, case):
    first, probe, live = case
    task = docker_task("processes")
    start = bash(first)
    assert run(api, task, "r1", start)["result"]["stdout"] == "started\n"
    assert run(api, task, "r1", bash(probe))["result"]["stdout"] == live  # the live rollout
    assert answers_of_later_rollouts(api, task, start, probe) == [live] * 3
    node = Node.objects.get(task_id=task, depth=1, mutates=True)
    assert node.live_processes >= 1
    assert not Snapshot.objects.filter(task_id=task, node=node).exists()  # no fork could have used it


def test_a_state_that_keeps_changing_is_kept_off_shared_keys(api, docker_task, snapshot_every_call):
    first, probe, live = WRITER
    task = docker_task("drift")
    start = bash(first)
    run(api, task, "r1", start)
    time.sleep(0.5)  # the policy thinks; the loop writes meanwhile
    assert run(api, task, "r1", bash(probe))["result"]["stdout"] == live
    # The state the first call left depended on when it was looked at. Usually the loop's pause lets
    # it be recorded and the next call finds it drifted; a loop that wrote while the state was being
    # fingerprinted has it not recorded at all. Either way no node of it is served, the live rollout
    # left the shared graph, and a later rollout runs the call live, at its own time.
    node = Node.objects.filter(task_id=task, depth=1, mutates=True).first()
    assert node is None or (
        node.divergent and Divergence.objects.filter(task_id=task, node=node, kind="drift").exists()
    )
    assert Rollout.objects.get(task_id=task, rollout_id="r1").detached_at is not None
    assert run(api, task, "r2", start)["cached"] is False
    assert run(api, task, "r2", bash(f"{probe} # r2"))["result"]["stdout"] == live
    # A writer that never pauses: its state changes before it is recorded, and a loop starved of
    # CPU through both looks is still at work (runnable), so it is not settled either: nothing is
    # recorded. Every rollout answers as a live one, and no node of the loop is left to serve.
    task = docker_task("unsettled")
    restless = bash(
        "(while :; do echo x >> /log; done) >/dev/null 2>&1 & while [ ! -s /log ]; do :; done; echo started"
    )
    for rollout in ("r1", "r2", "r3"):
        assert run(api, task, rollout, restless)["result"]["stdout"] == "started\n"
        assert run(api, task, rollout, bash(probe))["result"]["stdout"] == live
    assert not Node.objects.filter(task_id=task, divergent=False).exists()


def test_a_server_in_the_debian_image_answers_every_rollout(api, docker_task, busybox, snapshot_every_call):
    try:
        busybox.images.get(DEBIAN_TAG)
    except docker.errors.ImageNotFound:
        pytest.fail(f"{DEBIAN_TAG} is not built: run manage.py build_images (.ci/test.sh does)")
    first, probe, live = HTTP
    task = docker_task("http", env={"backend": "docker", "image": DEBIAN_TAG})
    start = bash(first)
    assert run(api, task, "r1", start)["result"]["stdout"] == "started\n"
    assert run(api, task, "r1", bash(probe))["result"]["stdout"] == live
    assert answers_of_later_rollouts(api, task, start, probe, rollouts=2) == [live] * 2


def test_a_call_that_only_starts_or_stops_a_process_changes_the_state(api, docker_task):
    task = docker_task("daemon-only")
    setup = bash("mkdir -p /www && echo page > /www/x")
    serve = bash("busybox httpd -p 8089 -h /www")  # writes no file: its state is its process
    fetch = bash("wget -qO- http://127.0.0.1:8089/x 2>/dev/null || echo unreachable")
    run(api, task, "r1", setup)
    assert run(api, task, "r1", serve)["mutates"] is True
    assert run(api, task, "r1", fetch)["result"]["stdout"] == "page\n"
    # r2 never started the server: its fetch must not hit r1's.
    run(api, task, "r2", setup)
    other = run(api, task, "r2", fetch)
    assert (other["cached"], other["result"]["stdout"]) == (False, "unreachable\n")
    stop = bash("kill $(ps -o pid,args | awk '/httpd -p 808[9]/ {print $1}'); sleep 0.2; echo stopped")
    assert run(api, task, "r1", stop)["mutates"] is True
    assert run(api, task, "r1", fetch)["result"]["stdout"] == "unreachable\n"


def test_processes_left_by_a_replay_are_verified_and_materializations_counted(api, docker_task, snapshot_every_call):
    first, probe, live = BACKGROUND
    task = docker_task("counted")
    start, write = bash(first), bash("echo more >> /notes")  # a cheap call after it: snapshotted, processes and all
    run(api, task, "r1", start)
    run(api, task, "r1", write)
    run(api, task, "r1", bash(probe))
    run(api, task, "r2", start)
    run(api, task, "r2", write)
    assert run(api, task, "r2", bash(f"{probe} # r2"))["result"]["stdout"] == live
    assert Snapshot.objects.filter(task_id=task).count() == 0
    assert Rollout.objects.get(task_id=task, rollout_id="r2").detached_at is None  # replayed, verified, shared
    ledger_flush()
    counts = {(m.how, m.processes): m.count for m in MaterializationStat.objects.filter(task_id=task)}
    assert counts.get(("root", True)) == 1
    shown = api.get(f"/api/v1/tasks/{task}/stats").json()["processes"]  # as the dashboard shows them
    assert shown["states"] == 2 and shown["snapshots"] == 0
    assert {"how": "root", "label": "a fresh sandbox and a replay", "with_processes": 1, "without": 1} in shown[
        "materialized"
    ]


COMMANDS = [
    "rm -rf /.tvcache; echo removed",
    "mkfifo /.tvcache && ls -la / | grep tvcache | cut -c1",
    "cd /tmp && export GREETING=hi && touch here",
    'pwd; echo "$GREETING"; ls',
    "ls -a / | tr '\\n' ' '",
    "rm -f /.tvcache; ln -s /dev/zero /.tvcache && echo linked",
    'cd / && echo "$GREETING $OLDPWD"',
]


def test_removing_or_replacing_what_tvcache_once_kept_in_the_sandbox_goes_on_as_a_plain_container(
    api, docker_task, busybox
):
    task = docker_task("bookkeeping")
    answers = []
    for command in COMMANDS:
        answer = run(api, task, "r1", bash(command))
        answers.append((answer["result"]["stdout"], answer["result"]["exit_code"]))
    assert answers == plain_container(busybox, COMMANDS)
    assert Rollout.objects.get(task_id=task, rollout_id="r1").detached_at is None
    # Another rollout hits them all, and one that misses later finds the same session.
    for command in COMMANDS:
        assert run(api, task, "r2", bash(command))["cached"] is True
    assert run(api, task, "r2", bash('pwd; echo "$GREETING"'))["result"]["stdout"] == "/\nhi\n"


def plain_container(client: docker.DockerClient, commands: list[str]) -> list[tuple[str, int]]:
    """What the commands answer without tvcache: one shell of a plain container of the same image
    runs them in turn (so the working directory and exports carry over, as tvcache's session keeps
    them), each one's output and status followed by a NUL."""
    script = "".join(f"{{ {command}\n}} 2>/dev/null; printf '\\0%s\\0' $?\n" for command in commands)
    container = client.containers.run(
        "tvcache/busybox:latest", ["sleep", "60"], detach=True, init=True, network_mode="none", hostname="sandbox"
    )
    try:
        _, out = container.exec_run(["sh", "-c", script])
    finally:
        container.remove(force=True)
    fields = out.decode().split("\0")
    return [(fields[2 * i], int(fields[2 * i + 1])) for i in range(len(commands))]
