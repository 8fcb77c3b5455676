"""Sandbox runtimes (real engine, configured by .ci/setup.sh with runc and gVisor's runsc): the
runtime choice, checkpoint snapshots that keep processes and memory, and confinement under runsc."""

from __future__ import annotations

import os

import pytest

from sandboxes.backends import hostfs
from sandboxes.backends.base import InvalidEnv, SnapshotMissing
from sandboxes.backends.docker import DockerSandbox
from sandboxes.backends.docker.checkpoint import (
    ProcessesNotKept,
    RuntimeNotGranted,
    RuntimeUnavailable,
    _copy_tree,
)
from tests.support.docker import make_docker_backend

pytestmark = pytest.mark.docker

RUNSC = {"backend": "docker", "runtime": "runsc"}
# A state with live processes: a daemonized web server, a background process, and a counter loop
# that keeps its count in memory and writes it out only when poked (only a restored memory has it).
LIVE_STATE = (
    "mkdir -p /www && echo page > /www/x && busybox httpd -p 8089 -h /www && "
    "(sleep 300 >/dev/null 2>&1 &) && "
    "(i=0; while true; do i=$((i+1)); if [ -e /poke ]; then echo $i > /count; rm /poke; fi; sleep 0.05; done "
    ">/dev/null 2>&1 &) && echo started"
)
PROBE = (
    "wget -qO- http://127.0.0.1:8089/x || echo unreachable; ps -o args | grep -c '^sleep 300'; "
    "rm -f /count; touch /poke; for i in 1 2 3 4 5 6 7 8 9 10; do [ -e /count ] && break; sleep 0.1; done; "
    "cat /count 2>/dev/null || echo 0"
)


def bash(sandbox: DockerSandbox, command: str, **args: object) -> dict:
    return sandbox.execute("bash", {"command": command, **args})


def probe(sandbox: DockerSandbox) -> tuple[str, str, int]:
    page, sleeps, count = bash(sandbox, PROBE)["stdout"].split("\n")[:3]
    return page, sleeps, int(count)


def test_a_runsc_snapshot_keeps_processes_in_its_forks_and_the_source_goes_on(docker_backend, test_labels):
    source = docker_backend.start(RUNSC, labels=test_labels)
    assert bash(source, LIVE_STATE)["stdout"] == "started\n"
    info = source.snapshot(labels=test_labels)
    assert info.keeps_processes is True
    fork = docker_backend.fork(info.ref, RUNSC, labels=test_labels)
    assert fork.state_fingerprint() == source.state_fingerprint()  # the same files, as the commit left them
    # The loop's count was only ever in its memory: the fork goes on counting from where it was.
    page, sleeps, count = probe(fork)
    assert (page, sleeps) == ("page", "1") and count > 1
    assert probe(source)[:2] == ("page", "1")  # the source was restored from the same checkpoint
    # A fork's own snapshot keeps them too.
    second = fork.snapshot(labels=test_labels)
    again = docker_backend.fork(second.ref, RUNSC, labels=test_labels)
    assert probe(again)[:2] == ("page", "1")
    for ref in (info.ref, second.ref):  # with their stored checkpoints
        docker_backend.delete_snapshot(ref)


def test_a_runc_snapshot_keeps_files_only(docker_backend, test_labels):
    env = {"backend": "docker"}
    source = docker_backend.start(env, labels=test_labels)
    bash(source, LIVE_STATE)
    info = source.snapshot(labels=test_labels)
    assert info.keeps_processes is False
    page, sleeps, _ = probe(docker_backend.fork(info.ref, env, labels=test_labels))
    assert (page, sleeps) == ("unreachable", "0")


def test_a_fork_whose_checkpoint_is_gone_is_a_missing_snapshot(docker_backend, test_labels):
    source = docker_backend.start(RUNSC, labels=test_labels)
    bash(source, "sleep 300 >/dev/null 2>&1 &")
    ref = source.snapshot(labels=test_labels).ref
    store = docker_backend.checkpoint_store()
    folder = os.path.join(store.root, ref.split(":")[1])
    assert os.path.isdir(folder)
    docker_backend.delete_snapshot(ref)
    assert not os.path.exists(folder)
    with pytest.raises(SnapshotMissing):
        docker_backend.fork(ref, RUNSC, labels=test_labels)
    assert bash(source, "echo on")["stdout"] == "on\n"


def test_the_runtime_is_the_operators_choice_and_refusals_have_stable_codes(docker_backend, busybox_image):
    runc, runsc = docker_backend.fingerprint_material({"backend": "docker"}), docker_backend.fingerprint_material(RUNSC)
    assert "runtime" not in runc and runsc["runtime"] == "runsc"  # runsc's results are its own kernel's
    # Asking for processes that survive snapshots picks the runtime that keeps them.
    assert docker_backend.fingerprint_material({"backend": "docker", "keep_processes": True}) == runsc
    refusals = [
        ({"runtime": "kata"}, RuntimeNotGranted, "runtime_not_granted"),
        ({"runtime": "runc", "keep_processes": True}, ProcessesNotKept, "processes_not_kept"),
        ({"runtime": 3}, InvalidEnv, "invalid_env"),
        ({"keep_processes": "yes"}, InvalidEnv, "invalid_env"),
    ]
    for extra, error, code in refusals:
        with pytest.raises(error) as refused:
            docker_backend.fingerprint_material({"backend": "docker", **extra})
        assert refused.value.code == code
    # An operator who grants runsc on an engine that lacks it, or who runs it without a network.
    elsewhere = make_docker_backend(runtimes=("runc", "runsc", "kata"))
    with pytest.raises(RuntimeUnavailable) as missing:
        elsewhere.fingerprint_material({"backend": "docker", "runtime": "kata"})
    assert missing.value.code == "runtime_unavailable"
    with pytest.raises(RuntimeUnavailable):
        make_docker_backend(allow_network=True).fingerprint_material({**RUNSC, "network": True})
    # An operator who keeps runc the only runtime, or takes checkpoints from none.
    with pytest.raises(RuntimeNotGranted):
        make_docker_backend(runtimes=("runc",)).fingerprint_material(RUNSC)
    with pytest.raises(ProcessesNotKept):
        make_docker_backend(checkpoint_runtimes=()).fingerprint_material({"backend": "docker", "keep_processes": True})
    # The operator's default runtime serves the tasks that name none.
    assert make_docker_backend(runtime="runsc").fingerprint_material({"backend": "docker"}) == runsc


def test_runsc_sandboxes_are_confined_alike(docker_client, test_labels, busybox_image):
    backend = make_docker_backend(ulimit_nofile=64)
    env = {**RUNSC, "limits": {"memory_mb": 256, "cpus": 0.5, "pids": 64}}
    sandbox = backend.start(env, labels=test_labels)
    container = docker_client.api.inspect_container(sandbox.sandbox_id)
    host = container["HostConfig"]
    assert host["Runtime"] == "runsc" and host["NetworkMode"] == "none"
    # The engine's pids limit counts the runtime's host tasks, about ten per sandbox process.
    assert (host["Memory"], host["NanoCpus"], host["PidsLimit"]) == (256 * 2**20, 500_000_000, 64 * 16 + 256)
    assert host["Privileged"] is False and host["CapDrop"] == ["ALL"] and "no-new-privileges" in host["SecurityOpt"]
    assert not host["Binds"] and container["Mounts"] == []
    assert bash(sandbox, "ls /sys/class/net")["stdout"].split() in ([], ["lo"])
    assert bash(sandbox, "wget -T 2 -qO- http://1.1.1.1/ || echo offline")["stdout"].endswith("offline\n")
    assert bash(sandbox, "ulimit -n")["stdout"] == "64\n"
    # confinement.py's capabilities, as under runc.
    assert bash(sandbox, "grep CapEff /proc/self/status")["stdout"].split()[1] == "00000000000005fb"


def test_a_timeout_under_runsc_kills_the_call_and_spares_what_earlier_calls_left(docker_backend, test_labels):
    sandbox = docker_backend.start(RUNSC, labels=test_labels)
    bash(sandbox, "setsid sleep 300 > /dev/null 2>&1 < /dev/null &")
    result = bash(sandbox, "setsid sleep 61 & sleep 60", timeout_s=0.5)
    assert result["timed_out"] is True and result["exit_code"] is not None
    processes = bash(sandbox, "ps -o pid,args")["stdout"]
    assert "sleep 300" in processes and "sleep 61" not in processes and "sleep 60" not in processes
    assert bash(sandbox, "echo alive")["stdout"] == "alive\n"


def test_a_checkpoint_is_copied_without_following_links(tmp_path):
    source, outside = tmp_path / "checkpoint", tmp_path / "outside"
    source.mkdir()
    outside.write_text("host secret")
    (source / "checkpoint.img").write_bytes(b"state")
    (source / "pages.img").symlink_to(outside)
    with pytest.raises(hostfs.UnsafeEntry):
        _copy_tree(str(source), str(tmp_path / "copy"), max_bytes=1 << 20)
    (source / "pages.img").unlink()
    (source / "big.img").write_bytes(b"x" * 2048)
    with pytest.raises(hostfs.UnsafeEntry):
        _copy_tree(str(source), str(tmp_path / "copy2"), max_bytes=1024)
    assert _copy_tree(str(source), str(tmp_path / "copy3"), max_bytes=1 << 20) == 2053
    assert (tmp_path / "copy3" / "checkpoint.img").read_bytes() == b"state"
