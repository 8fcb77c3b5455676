"""Docker sandboxes are confined by the service's settings, not by the task's spec (real engine)."""

from __future__ import annotations

import time

import pytest

from sandboxes.backends.base import (
    ImageNotAllowed,
    InvalidEnv,
    LimitExceeded,
    NetworkNotGranted,
    SandboxOverQuota,
    UserNotAllowed,
)
from sandboxes.backends.docker import DockerSandbox
from sandboxes.images import DEBIAN_TAG
from tests.support.docker import make_docker_backend

pytestmark = pytest.mark.docker

ENV = {"backend": "docker"}


def bash(sandbox: DockerSandbox, command: str, **args: object) -> dict:
    return sandbox.execute("bash", {"command": command, **args})


def host_config(docker_client, sandbox: DockerSandbox) -> dict:
    return docker_client.api.inspect_container(sandbox.sandbox_id)["HostConfig"]


def test_limits_above_the_operators_maxima_are_refused(docker_client, test_labels, busybox_image):
    backend = make_docker_backend(max_memory_mb=300, max_cpus=0.5, max_pids=100)
    for limits in ({"memory_mb": 301}, {"cpus": 0.75}, {"pids": 101}, {"memory_mb": 2**70}, {"cpus": float("inf")}):
        with pytest.raises(LimitExceeded) as refused:
            backend.start({**ENV, "limits": limits}, labels=test_labels)
        assert refused.value.code == "limit_exceeded"
        assert refused.value.details["limit"] == next(iter(limits))
        with pytest.raises(LimitExceeded):
            backend.fingerprint_material({**ENV, "limits": limits})
    with pytest.raises(InvalidEnv):
        backend.start({**ENV, "limits": {"cpus": float("nan")}}, labels=test_labels)
    at_most = backend.start({**ENV, "limits": {"memory_mb": 300, "cpus": 0.5, "pids": 100}}, labels=test_labels)
    host = host_config(docker_client, at_most)
    assert (host["Memory"], host["NanoCpus"], host["PidsLimit"]) == (300 * 2**20, 500_000_000, 100)
    assert bash(at_most, "echo ok")["stdout"] == "ok\n"
    # The service's defaults (512 MB, 1 CPU, 256 pids) never exceed its maxima either.
    assert backend.fingerprint_material(ENV)["limits"] == {"memory_mb": 300, "cpus": 0.5, "pids": 100}


def test_a_snapshot_or_an_unlisted_image_is_refused(docker_client, docker_backend, test_labels):
    sandbox = docker_backend.start(ENV, labels=test_labels)
    snapshot = sandbox.snapshot().ref  # a local image another task's sandbox left: never a task's image
    for image in (snapshot, docker_client.api.inspect_image(snapshot)["Id"], "tvcache/snapshot:" + "0" * 32):
        with pytest.raises(ImageNotAllowed) as refused:
            docker_backend.start({**ENV, "image": image}, labels=test_labels)
        assert refused.value.code == "image_not_allowed" and snapshot not in refused.value.details["allowed"]
        with pytest.raises(ImageNotAllowed):
            docker_backend.fingerprint_material({**ENV, "image": image})
    # Listing a snapshot image does not allow it; a listed image is allowed, with or without its tag.
    listing = make_docker_backend(images=(snapshot, "tvcache/busybox"))
    with pytest.raises(ImageNotAllowed):
        listing.start({**ENV, "image": snapshot}, labels=test_labels)
    with pytest.raises(ImageNotAllowed):
        listing.start({**ENV, "image": DEBIAN_TAG}, labels=test_labels)
    assert (
        bash(listing.start({**ENV, "image": "tvcache/busybox:latest"}, labels=test_labels), "echo ok")["stdout"]
        == "ok\n"
    )


def test_network_needs_the_operators_grant(docker_client, docker_backend, test_labels, busybox_image):
    with pytest.raises(NetworkNotGranted) as refused:
        docker_backend.start({**ENV, "network": True}, labels=test_labels)
    assert refused.value.code == "network_not_granted"
    with pytest.raises(NetworkNotGranted):
        docker_backend.fingerprint_material({**ENV, "network": True})
    granted = make_docker_backend(allow_network=True).start({**ENV, "network": True}, labels=test_labels)
    assert host_config(docker_client, granted)["NetworkMode"] == "bridge"


def test_a_non_root_user_keeps_its_session_across_calls_and_forks(docker_backend, test_labels):
    env = {**ENV, "user": "1000"}
    sandbox = docker_backend.start(env, labels=test_labels)
    assert bash(sandbox, 'id -u; id -g; pwd; echo "$HOME"')["stdout"] == "1000\n1000\n/home/sandbox\n/home/sandbox\n"
    denied = bash(sandbox, "touch /etc/owned")
    assert denied["exit_code"] != 0 and "denied" in denied["stderr"].lower()
    bash(sandbox, "mkdir -p w && cd w && echo mine > f && export MARK=1")
    fork = docker_backend.fork(sandbox.snapshot().ref, env, labels=test_labels)
    assert bash(fork, 'id -u; pwd; cat f; echo "$MARK"')["stdout"] == "1000\n/home/sandbox/w\nmine\n1\n"


def test_a_non_root_operator_default_is_a_floor(docker_backend, test_labels, busybox_image):
    backend = make_docker_backend(user="1000:1000")
    assert bash(backend.start(ENV, labels=test_labels), "id -u")["stdout"] == "1000\n"
    assert bash(backend.start({**ENV, "user": "2000:2000"}, labels=test_labels), "id -u")["stdout"] == "2000\n"
    for user in ("0", "0:0", ""):
        with pytest.raises(UserNotAllowed) as refused:
            backend.start({**ENV, "user": user}, labels=test_labels)
        assert refused.value.code == "user_not_allowed"
    for user in ("root", "1000:x", 1000, "-1"):
        with pytest.raises(InvalidEnv):
            docker_backend.fingerprint_material({**ENV, "user": user})
    # The user and the service's ulimits and quota decide results: they are in the fingerprint.
    assert docker_backend.fingerprint_material({**ENV, "user": "1000"}) != docker_backend.fingerprint_material(ENV)
    assert make_docker_backend(ulimit_nofile=64).fingerprint_material(ENV) != docker_backend.fingerprint_material(ENV)


def test_ulimits_bind_every_call(test_labels, busybox_image):
    backend = make_docker_backend(ulimit_nofile=64, ulimit_fsize_mb=1)
    sandbox = backend.start(ENV, labels=test_labels)
    assert bash(sandbox, "ulimit -n")["stdout"] == "64\n"
    bash(sandbox, "dd if=/dev/zero of=/big bs=1024 count=2048 2>/dev/null")
    assert bash(sandbox, "wc -c < /big")["stdout"].strip() == str(2**20)


def test_a_call_past_the_disk_quota_removes_the_sandbox(docker_client, test_labels, busybox_image):
    backend = make_docker_backend(disk_mb=4)
    sandbox = backend.start(ENV, labels=test_labels)
    # The engine enforces an overlay size only on xfs with pquota; elsewhere the layer is watched.
    storage_opt = host_config(docker_client, sandbox).get("StorageOpt") or {}
    assert backend.storage_quota is (storage_opt.get("size") == "4M")
    bash(sandbox, "dd if=/dev/zero of=/a bs=1024 count=3072 2>/dev/null")
    with pytest.raises(SandboxOverQuota) as over:
        bash(sandbox, "dd if=/dev/zero of=/b bs=1024 count=3072 2>/dev/null; echo written")
    assert over.value.code == "disk_quota_exceeded" and over.value.details["disk_mb"] == 4
    assert not sandbox.alive() and backend.list_sandboxes(test_labels) == []
    with pytest.raises(SandboxOverQuota):
        bash(sandbox, "true")


def test_a_background_writer_is_stopped_between_calls(test_labels, busybox_image):
    backend = make_docker_backend(disk_mb=4, disk_check_s=0.2)
    sandbox = backend.start(ENV, labels=test_labels)
    # A file each round: the fsize ulimit keeps any one file under the quota.
    bash(
        sandbox,
        "(sleep 2; i=0; while true; do i=$((i + 1)); dd if=/dev/zero bs=1024 count=1024 of=/grow$i; done) "
        "> /dev/null 2>&1 &",
    )
    deadline = time.monotonic() + 30
    while sandbox.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not sandbox.alive()
    with pytest.raises(SandboxOverQuota):
        bash(sandbox, "true")


def test_many_small_files_or_deep_folders_count_against_the_quota(test_labels, busybox_image):
    backend = make_docker_backend(disk_max_files=300)
    sandbox = backend.start(ENV, labels=test_labels)
    bash(sandbox, "mkdir /few && cd /few && touch $(seq 100)")
    with pytest.raises(SandboxOverQuota) as over:
        bash(sandbox, "mkdir /many && cd /many && touch $(seq 400)")
    assert "files" in over.value.message
    deep = backend.start(ENV, labels=test_labels)
    with pytest.raises(SandboxOverQuota):
        bash(deep, "i=0; while [ $i -lt 140 ]; do mkdir d && cd d; i=$((i+1)); done; echo hidden > f")


def _processes(sandbox: DockerSandbox) -> str:
    return bash(sandbox, "ps -o pid,args")["stdout"]


def test_a_timeout_kills_the_call_whatever_the_sandbox_wrote_in_its_pid_file(sandbox_with_busybox):
    sandbox = sandbox_with_busybox
    result = bash(sandbox, "mkdir -p /.tvcache; echo 99999 > /.tvcache/pid; sleep 60", timeout_s=0.5)
    assert result["timed_out"] is True and result["exit_code"] is not None
    assert "sleep 60" not in _processes(sandbox)


def test_a_timeout_kills_what_the_call_moved_to_a_session_of_its_own(sandbox_with_busybox):
    sandbox = sandbox_with_busybox
    result = bash(sandbox, "setsid sleep 61 & sleep 60", timeout_s=0.5)
    assert result["timed_out"] is True
    processes = _processes(sandbox)
    assert "sleep 61" not in processes and "sleep 60" not in processes


def test_a_timeout_spares_what_earlier_calls_left_running(sandbox_with_busybox):
    sandbox = sandbox_with_busybox
    bash(sandbox, "setsid sleep 300 > /dev/null 2>&1 < /dev/null &")
    assert bash(sandbox, "sleep 60", timeout_s=0.5)["timed_out"] is True
    processes = _processes(sandbox)
    assert "sleep 300" in processes and "sleep 60" not in processes
    assert bash(sandbox, "echo alive")["stdout"] == "alive\n"


@pytest.fixture
def sandbox_with_busybox(docker_backend, test_labels) -> DockerSandbox:
    return docker_backend.start(ENV, labels=test_labels)
