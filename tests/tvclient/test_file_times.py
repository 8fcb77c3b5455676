"""Client mode: a rollout's environment caught up by replay carries the file times of the live run
(tools such as make and Python's bytecode cache read them). tvclient against a live tvcache
server (real HTTP, real PostgreSQL) with the lab's docker environment (a real Docker engine)."""

from __future__ import annotations

import time

import pytest

from accounts.services.tokens import token_create
from cache.models import Node
from lab.replay.terminal import DockerEnvironment
from sandboxes.images import build_busybox_image
from tvclient import SnapshotStore, ToolCallExecutor, TVCacheClient

pytestmark = pytest.mark.django_db(transaction=True)


def bash(command: str) -> dict:
    return {"tool": "bash", "args": {"command": command}}


# A build cache keyed on whole-second modification times, as Python's .pyc check is: the cached
# copy is reused while the source's time, in seconds, is the one it was made from.
WRITE_V1, WRITE_V2 = bash("echo v1 > /src"), bash("echo v2 > /src")  # the same size
BUILD = bash(
    '[ "$(cat /built.at 2>/dev/null)" = "$(stat -c %Y /src)" ] '
    "|| { cp /src /built; stat -c %Y /src > /built.at; }; cat /built"
)


@pytest.fixture
def client(live_server):
    build_busybox_image()
    with TVCacheClient(live_server.url, token_create(name="live")) as client:
        yield client


def docker_env() -> DockerEnvironment:
    return DockerEnvironment({"backend": "docker", "network": False})  # the service's busybox image


def test_a_replay_in_the_client_carries_the_file_times_of_the_live_run(client):
    # Live, the two writes land seconds apart and the second build sees v2. A replay runs the same
    # calls back to back, within one second: with the replay's own times the build cache served v1.
    # The executor writes back the times each call left when it ran live, as the service recorded them.
    store = SnapshotStore()
    try:
        for attempt in range(3):  # a replay that happens to cross a second boundary hides the defect
            task = f"client-file-times-{attempt}"
            client.put_task(task, env={"backend": "external", "image": "busybox", "test": attempt}, sandbox_budget=0)
            with ToolCallExecutor(client, task, docker_env, rollout_id="r1", snapshots=store) as live:
                assert live.execute(WRITE_V1)["exit_code"] == 0
                assert live.execute(BUILD)["stdout"] == "v1\n"
                time.sleep(1.1)
                assert live.execute(WRITE_V2)["exit_code"] == 0
                assert live.execute(BUILD)["stdout"] == "v2\n"
            assert live.misses == 4 and live.record_failures == 0
            assert set(Node.objects.get(task_id=task, call=WRITE_V1).file_times) == {"src"}
            with ToolCallExecutor(client, task, docker_env, rollout_id="r2", snapshots=store) as replayed:
                for call in (WRITE_V1, BUILD, WRITE_V2):
                    replayed.execute(call)
                assert replayed.hits == 3  # no environment yet
                answer = replayed.execute(bash(BUILD["args"]["command"] + "; echo built"))
                assert (replayed.misses, replayed.replayed) == (1, 3)
                assert answer["stdout"] == "v2\nbuilt\n"
    finally:
        store.close()
