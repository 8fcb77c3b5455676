"""The docker backend against the real engine (busybox image: `sh` is ash)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import docker
import docker.errors
import pytest

from sandboxes.backends.base import (
    EngineUnavailable,
    InvalidEnv,
    InvalidToolArgs,
    SandboxGone,
    SnapshotMissing,
    ToolNotFound,
)
from sandboxes.backends.docker import DockerBackend, DockerSandbox
from sandboxes.images import DEBIAN_TAG
from tests.support.docker import make_docker_backend

pytestmark = pytest.mark.docker

ENV = {"backend": "docker"}


def bash(sandbox: DockerSandbox, command: str, **args: object) -> dict:
    return sandbox.execute("bash", {"command": command, **args})


@pytest.fixture
def sandbox(docker_backend: DockerBackend, test_labels: dict[str, str]) -> DockerSandbox:
    return docker_backend.start(ENV, labels=test_labels)


def test_bash_returns_stdout_stderr_and_exit_code(sandbox):
    result = bash(sandbox, "echo out; echo err >&2; exit 3")
    assert result == {"stdout": "out\n", "stderr": "err\n", "exit_code": 3, "timed_out": False, "truncated": False}


def test_stale_read_sees_the_new_content(sandbox):
    bash(sandbox, "echo old > f")
    assert bash(sandbox, "cat f")["stdout"] == "old\n"
    bash(sandbox, "echo new > f")
    assert bash(sandbox, "cat f")["stdout"] == "new\n"


def test_cwd_and_exported_variables_persist_like_one_shell(sandbox):
    bash(sandbox, "mkdir -p /work/repo && cd /work/repo && export GREETING=\"it's 'quoted'\" && LOCAL=1")
    result = bash(sandbox, 'pwd; echo "$GREETING"; echo "local=$LOCAL"')
    assert result["stdout"] == "/work/repo\nit's 'quoted'\nlocal=\n"


def test_a_command_that_exits_early_still_keeps_its_cwd(sandbox):
    bash(sandbox, "cd /tmp; export A=1; exit 7")
    assert bash(sandbox, 'pwd; echo "$A"')["stdout"] == "/tmp\n1\n"


def test_unset_variables_stay_unset_even_the_image_ones(sandbox):
    bash(sandbox, "unset HOME LANG")
    assert bash(sandbox, 'echo "home=$HOME lang=$LANG"')["stdout"] == "home= lang=\n"


def test_cwd_and_exports_survive_snapshot_and_fork(docker_backend, sandbox, test_labels):
    bash(sandbox, "mkdir -p /srv/app && cd /srv/app && export BUILD=42 && echo v1 > state")
    snap = sandbox.snapshot()
    fork = docker_backend.fork(snap.ref, ENV, labels=test_labels)
    assert bash(fork, 'pwd; echo "$BUILD"; cat state')["stdout"] == "/srv/app\n42\nv1\n"


def test_fork_and_parent_are_independent(docker_backend, sandbox, test_labels):
    bash(sandbox, "echo base > /root/f")
    ref = sandbox.snapshot().ref
    fork = docker_backend.fork(ref, ENV, labels=test_labels)
    bash(fork, "echo fork > /root/f; export ONLY_IN_FORK=1")
    bash(sandbox, "echo parent > /root/g")
    assert bash(sandbox, 'cat /root/f; echo "[$ONLY_IN_FORK]"')["stdout"] == "base\n[]\n"
    assert bash(fork, "cat /root/f; ls /root")["stdout"] == "fork\nf\n"
    # The snapshot is immutable: a second fork sees the state at snapshot time.
    second = docker_backend.fork(ref, ENV, labels=test_labels)
    assert bash(second, "cat /root/f; ls /root")["stdout"] == "base\nf\n"


def observed(sandbox: DockerSandbox, command: str) -> bool | None:
    return sandbox.execute_observed("bash", {"command": command})[1]


def test_calls_that_change_nothing_are_observed_read_only(sandbox):
    assert observed(sandbox, "ls /") is False  # the first call too: the session files are as the start left them
    assert observed(sandbox, "mkdir -p /w && cd /w && echo a > f") is True
    changes = [
        "echo a > f",  # the same content again: a write all the same
        "touch -d 2020-01-01 f",
        "chmod 600 f",
        "ln f g",
        "rm g",
        "mkdir d",
        "rmdir d",
        "rm /bin/arch",
        "echo 10.0.0.1 x >> /etc/hosts",  # bind-mounted from the host, outside the layer
        "cd /",
        "cd /w",
        "export A=1",
        "export A=2",
        "unset A",
    ]
    for command in changes:
        assert observed(sandbox, command) is True, command
    for command in ["cat f", "ls -la /w", "pwd", 'echo "$A"', "A=3", "touch /dev/shm/x; rm /dev/shm/x"]:
        assert observed(sandbox, command) is False, command


def test_a_forks_first_call_is_observed_like_any_other(docker_backend, sandbox, test_labels):
    bash(sandbox, "mkdir -p /w && cd /w && echo a > f && export B=1")
    fork = docker_backend.fork(sandbox.snapshot().ref, ENV, labels=test_labels)
    assert observed(fork, 'cat f; echo "$B"') is False
    assert observed(fork, "echo b >> f") is True


def test_a_layer_past_the_cap_is_no_longer_observed(test_labels, busybox_image):
    sandbox = make_docker_backend(observe_max_entries=50).start(ENV, labels=test_labels)
    assert observed(sandbox, "ls") is False
    assert observed(sandbox, "mkdir /many && cd /many && touch $(seq 60)") is None
    assert observed(sandbox, "ls") is None


def test_nothing_is_observed_when_switched_off(test_labels, busybox_image):
    sandbox = make_docker_backend(observe_writes=False).start(ENV, labels=test_labels)
    assert sandbox.execute_observed("bash", {"command": "true"}) == (
        {"stdout": "", "stderr": "", "exit_code": 0, "timed_out": False, "truncated": False},
        None,
    )


def test_snapshot_does_not_disturb_the_running_sandbox(sandbox):
    pid = bash(sandbox, "echo kept > /f; sleep 300 > /dev/null 2>&1 & echo $!")["stdout"].strip()
    info = sandbox.snapshot()
    assert info.size_bytes > 0 and info.create_ms > 0
    assert sandbox.alive()
    assert bash(sandbox, f"kill -0 {pid} && echo running")["stdout"] == "running\n"


def test_timeout_kills_the_command_and_marks_the_result(sandbox):
    started = time.monotonic()
    result = bash(sandbox, "echo before; sleep 60 & sleep 60", timeout_s=0.5)
    assert result["timed_out"] is True
    assert result["stdout"] == "before\n"
    assert time.monotonic() - started < 30  # far below the 60 s the command wanted
    assert "sleep 60" not in bash(sandbox, "ps")["stdout"]  # its background job was killed too


def test_output_over_the_cap_is_truncated(docker_backend, test_labels):
    backend = make_docker_backend(output_cap_bytes=1000)
    sandbox = backend.start(ENV, labels=test_labels)
    result = bash(sandbox, "yes | head -c 5000; echo short >&2")
    assert (len(result["stdout"]), result["truncated"], result["exit_code"]) == (1000, True, 0)
    assert result["stderr"] == "short\n"


def test_endless_output_is_cut_off(test_labels, busybox_image):
    backend = make_docker_backend(output_cap_bytes=100, output_kill_bytes=1024 * 1024)
    sandbox = backend.start(ENV, labels=test_labels)
    result = bash(sandbox, "yes", timeout_s=600)
    assert result["truncated"] is True and result["timed_out"] is False and len(result["stdout"]) == 100
    assert bash(sandbox, "echo alive")["stdout"] == "alive\n"


def test_no_network_in_the_container(docker_client, sandbox):
    interfaces = bash(sandbox, "ls /sys/class/net")["stdout"].split()
    assert interfaces == ["lo"]
    assert docker_client.api.inspect_container(sandbox.sandbox_id)["HostConfig"]["NetworkMode"] == "none"


def test_limits_and_hardening_are_applied(docker_client, docker_backend, test_labels):
    env = {**ENV, "limits": {"memory_mb": 256, "cpus": 0.5, "pids": 64}, "workdir": "/work"}
    sandbox = docker_backend.start(env, labels=test_labels)
    container = docker_client.api.inspect_container(sandbox.sandbox_id)
    host = container["HostConfig"]
    assert (host["Memory"], host["NanoCpus"], host["PidsLimit"]) == (256 * 2**20, 500_000_000, 64)
    assert host["Privileged"] is False and host["CapDrop"] == ["ALL"]
    assert "no-new-privileges" in host["SecurityOpt"]
    assert not host["Binds"] and container["Mounts"] == []
    assert bash(sandbox, "pwd")["stdout"] == "/work\n"


def test_default_limits_apply_when_the_task_sets_none(docker_client, sandbox):
    host = docker_client.api.inspect_container(sandbox.sandbox_id)["HostConfig"]
    assert (host["Memory"], host["NanoCpus"], host["PidsLimit"]) == (512 * 2**20, 1_000_000_000, 256)


def test_containers_and_snapshots_are_labelled_and_listed(docker_client, docker_backend, test_labels):
    sandbox = docker_backend.start(ENV, labels={**test_labels, "tvcache.rollout": "r1"})
    container_labels = docker_client.api.inspect_container(sandbox.sandbox_id)["Config"]["Labels"]
    assert container_labels["tvcache.owner"] == "tvcache" and container_labels["tvcache.rollout"] == "r1"
    snap = sandbox.snapshot(labels={"tvcache.node": "7"})
    image_labels = docker_client.api.inspect_image(snap.ref)["Config"]["Labels"]
    assert image_labels["tvcache.owner"] == "tvcache" and image_labels["tvcache.node"] == "7"

    fork = docker_backend.fork(snap.ref, ENV, labels={**test_labels, "tvcache.rollout": "r2"})
    rollout_1 = docker_backend.list_sandboxes({**test_labels, "tvcache.rollout": "r1"})
    assert [s.id for s in rollout_1] == [sandbox.sandbox_id]
    # A fork carries only the labels it was given, none of its snapshot's.
    fork_listing = docker_backend.list_sandboxes({**test_labels, "tvcache.rollout": "r2"})
    assert [s.id for s in fork_listing] == [fork.sandbox_id] and "tvcache.node" not in fork_listing[0].labels
    assert [s.id for s in docker_backend.list_snapshots({**test_labels, "tvcache.node": "7"})] == [snap.ref]


def test_remove_sandbox_by_id_and_stop_are_idempotent(docker_backend, sandbox, test_labels):
    docker_backend.remove_sandbox(sandbox.sandbox_id)
    docker_backend.remove_sandbox(sandbox.sandbox_id)
    sandbox.stop()
    assert not sandbox.alive()
    assert docker_backend.list_sandboxes(test_labels) == []


def test_two_stoppers_at_once_both_succeed(docker_backend, sandbox, test_labels):
    # A rollout's end and the reaper may remove the same container at once; docker answers the
    # second "removal already in progress" (seen in a replay as a 500 on DELETE .../rollouts/..).
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: docker_backend.remove_sandbox(sandbox.sandbox_id), range(4)))
    assert docker_backend.list_sandboxes(test_labels) == []


def test_deleted_snapshot_keeps_its_forks_and_leaves_with_the_last_one(
    docker_client, docker_backend, sandbox, test_labels
):
    snap = sandbox.snapshot()
    fork = docker_backend.fork(snap.ref, ENV, labels=test_labels)
    image_id = docker_client.api.inspect_image(snap.ref)["Id"]
    docker_backend.delete_snapshot(snap.ref)
    docker_backend.delete_snapshot(snap.ref)
    assert docker_backend.list_snapshots(test_labels) == []
    assert bash(fork, "echo still")["stdout"] == "still\n"
    with pytest.raises(SnapshotMissing):
        docker_backend.fork(snap.ref, ENV, labels=test_labels)
    fork.stop()
    with pytest.raises(docker.errors.ImageNotFound):
        docker_client.api.inspect_image(image_id)


def test_fork_of_an_unknown_snapshot_raises_snapshot_missing(docker_backend, test_labels):
    with pytest.raises(SnapshotMissing):
        docker_backend.fork("tvcache/snapshot:" + "0" * 32, ENV, labels=test_labels)
    with pytest.raises(SnapshotMissing):
        docker_backend.fork("tvcache/busybox:latest", ENV, labels=test_labels)


def test_unknown_tool_and_bad_args_are_rejected(sandbox):
    with pytest.raises(ToolNotFound) as error:
        sandbox.execute("python", {"code": "1"})
    assert error.value.code == "unknown_tool"
    with pytest.raises(InvalidToolArgs):
        sandbox.execute("bash", {"command": 42})
    with pytest.raises(InvalidToolArgs):
        sandbox.execute("bash", {"command": "true", "timeout_s": -1})


def test_a_container_killed_mid_call_raises_sandbox_gone(docker_client, sandbox):
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            bash(sandbox, "sleep 60", timeout_s=120)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            outcome.append(exc)

    worker = threading.Thread(target=call)
    worker.start()
    _wait_for_process(docker_client, sandbox.sandbox_id, "sleep 60")
    docker_client.api.kill(sandbox.sandbox_id)
    worker.join(timeout=60)
    assert len(outcome) == 1 and isinstance(outcome[0], SandboxGone)
    assert outcome[0].code == "sandbox_gone"
    with pytest.raises(SandboxGone):
        bash(sandbox, "echo again")


def _wait_for_process(client: docker.DockerClient, container_id: str, needle: str) -> None:
    # `docker top` looks from outside, without waiting for the sandbox's own lock.
    for _ in range(200):
        if any(needle in " ".join(p) for p in client.api.top(container_id)["Processes"]):
            return
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} never started")


def test_a_removed_container_raises_sandbox_gone(docker_client, sandbox):
    docker_client.api.remove_container(sandbox.sandbox_id, force=True)
    with pytest.raises(SandboxGone):
        bash(sandbox, "true")
    with pytest.raises(SandboxGone):
        sandbox.snapshot()


def test_unreachable_engine_raises_engine_unavailable():
    backend = make_docker_backend(base_url="unix:///tmp/nope.sock")
    with pytest.raises(EngineUnavailable) as error:
        backend.start(ENV, labels={})
    assert error.value.code == "engine_unavailable" and "nope.sock" in error.value.message
    with pytest.raises(EngineUnavailable):
        backend.list_sandboxes()
    assert backend.health()["ok"] is False


def test_health_reports_the_engine(docker_backend):
    health = docker_backend.health()
    assert health["ok"] is True and health["engine_version"]


def test_fingerprint_material_names_the_image_and_rejects_bad_specs(docker_client, docker_backend, busybox_image):
    material = docker_backend.fingerprint_material(ENV)
    assert material["image_id"] == docker_client.images.get(busybox_image).id
    assert material["limits"] == {"memory_mb": 512, "cpus": 1.0, "pids": 256}
    with pytest.raises(InvalidEnv):
        docker_backend.fingerprint_material({**ENV, "netwrok": True})
    with pytest.raises(InvalidEnv):
        docker_backend.fingerprint_material({**ENV, "limits": {"memory_mb": -1}})
    with pytest.raises(InvalidEnv):
        docker_backend.fingerprint_material({**ENV, "image": "tvcache/no-such-image:1"})


def test_starts_never_exceed_the_limiter(test_labels, busybox_image):
    backend = make_docker_backend(max_concurrent_starts=2)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, backend.limiter.in_flight)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    starters = [threading.Thread(target=backend.start, args=(ENV,), kwargs={"labels": test_labels}) for _ in range(5)]
    for starter in starters:
        starter.start()
    for starter in starters:
        starter.join()
    done.set()
    sampler.join()
    assert peak == 2
    assert len(backend.list_sandboxes(test_labels)) == 5


def test_debian_image_runs_bash_with_the_same_session_semantics(docker_client, docker_backend, test_labels):
    try:
        docker_client.images.get(DEBIAN_TAG)
    except docker.errors.ImageNotFound:
        pytest.fail(f"{DEBIAN_TAG} is not built: run manage.py build_images (.ci/test.sh does)")
    env = {**ENV, "image": DEBIAN_TAG}
    sandbox = docker_backend.start(env, labels=test_labels)
    bash(sandbox, "cd /usr/lib && export MSG='a \"b\" c'")
    assert bash(sandbox, 'echo "${BASH_VERSION:+bash} $PWD $MSG"')["stdout"] == 'bash /usr/lib a "b" c\n'
    fork = docker_backend.fork(sandbox.snapshot().ref, env, labels=test_labels)
    assert bash(fork, 'echo "$PWD $MSG"; python3 -c "print(6*7)"')["stdout"] == '/usr/lib a "b" c\n42\n'


def mtimes(sandbox: DockerSandbox, *paths: str) -> list[str]:
    return bash(sandbox, "stat -c %y " + " ".join(paths))["stdout"].split("\n")[:-1]


def test_a_fork_keeps_exact_file_times_so_make_sees_the_same_order(docker_backend, sandbox, test_labels):
    # The c-build divergence: an object built, then its source edited within the same second.
    # docker commit keeps whole seconds, so in a fork both were equally old and `make` said
    # "up to date" where the original sandbox rebuilt.
    bash(sandbox, "mkdir -p /w && cd /w && echo obj > calc.o && sleep 0.3 && echo src > calc.c")
    before = mtimes(sandbox, "/w/calc.o", "/w/calc.c")
    fork = docker_backend.fork(sandbox.snapshot().ref, ENV, labels=test_labels)
    assert mtimes(fork, "/w/calc.o", "/w/calc.c") == before  # to the nanosecond (busybox's -nt reads seconds)


def test_a_fork_of_a_fork_keeps_exact_times_too(docker_backend, sandbox, test_labels):
    bash(sandbox, "echo a > /a")
    first = docker_backend.fork(sandbox.snapshot().ref, ENV, labels=test_labels)
    bash(first, "echo b > /b; sleep 0.2; echo c > /c")
    before = mtimes(first, "/a", "/b", "/c")
    second = docker_backend.fork(first.snapshot().ref, ENV, labels=test_labels)
    assert mtimes(second, "/a", "/b", "/c") == before


def test_the_state_fingerprint_matches_across_forks_and_replays_and_differs_with_the_state(
    docker_backend, sandbox, test_labels
):
    steps = [
        "mkdir -p /w && cd /w && echo one > a && export X=1",
        "echo two > b; sleep 0.05; echo three > c",
        "rm /w/a; chmod 600 /w/b; ln -s b /w/link",
    ]
    for step in steps:
        bash(sandbox, step)
    expected = sandbox.state_fingerprint()
    assert expected is not None
    fork = docker_backend.fork(sandbox.snapshot().ref, ENV, labels=test_labels)
    assert fork.state_fingerprint() == expected
    replayed = docker_backend.start(ENV, labels=test_labels)
    for step in steps:
        bash(replayed, step)
    assert replayed.state_fingerprint().shape == expected.shape
    # A replay runs at another time: contents that embed it (or chance) differ, as between two live rollouts.
    bash(sandbox, "cat /proc/sys/kernel/random/uuid > /w/stamp")
    bash(replayed, "cat /proc/sys/kernel/random/uuid > /w/stamp")
    assert replayed.state_fingerprint().shape == sandbox.state_fingerprint().shape
    assert replayed.state_fingerprint().full != sandbox.state_fingerprint().full
    # A fork that then diverges, in content, in the order of times, or in the session, no longer matches.
    expected, ref = sandbox.state_fingerprint(), sandbox.snapshot().ref
    for change, shape_too in [
        ("echo TWO > /w/b", False),
        ("touch /w/b", False),
        ("echo longer > /w/b", True),
        ("chmod 644 /w/b", True),
        ("cd /", True),
        ("export X=2", True),
    ]:
        other = docker_backend.fork(ref, ENV, labels=test_labels)
        bash(other, change)
        assert other.state_fingerprint().full != expected.full, change
        assert (other.state_fingerprint().shape != expected.shape) is shape_too, change


@pytest.mark.parametrize("image", [None, "tvcache/debian:bookworm"])  # busybox's /sbin; debian's /usr/sbin
def test_a_replay_that_writes_back_the_live_times_has_their_order(docker_backend, test_labels, image):
    env = {**ENV, "image": image} if image else ENV
    steps = ["mkdir -p /w && echo one > /w/a", "sleep 1; echo two > /w/b; echo three > /w/a", "cp /w/a /w/c"]
    live = docker_backend.start(env, labels=test_labels)
    times = []
    for step in steps:
        live.execute_observed("bash", {"command": step})
        times.append(live.state_fingerprint().times)
    assert all(times) and "w/b" in times[1]
    replayed = docker_backend.start(env, labels=test_labels)
    for step, kept in zip(steps, times):
        replayed.execute("bash", {"command": step})
        replayed.restore_file_times(kept)
    # The engine's own docker-init, made when each container started, is left out of the order.
    assert replayed.state_fingerprint().order == live.state_fingerprint().order
    replayed.execute("bash", {"command": "touch /w/a"})
    assert replayed.state_fingerprint().order != live.state_fingerprint().order


def test_the_session_is_out_of_the_sandboxes_reach_and_survives_what_it_does(docker_backend, test_labels):
    """No file of the service's is in the sandbox: what a call does to any path, planting links,
    FIFOs or devices where the session files once were, is its own, and the session goes on."""
    sandbox = docker_backend.start(ENV, labels=test_labels)
    bash(sandbox, "mkdir -p /w && cd /w && export KEPT='a b'")
    assert bash(sandbox, "ls -a / | grep -c tvcache")["stdout"] == "0\n"
    for trap in [
        "rm -rf /.tvcache; mkfifo /.tvcache",
        "rm -f /.tvcache; ln -s /proc/kmsg /.tvcache",
        "rm -f /.tvcache; ln -s /dev/zero /.tvcache",
        "rm -rf /tmp/* /run/* 2>/dev/null; true",
    ]:
        started = time.monotonic()
        assert sandbox.execute_observed("bash", {"command": trap, "timeout_s": 10})[0]["exit_code"] == 0, trap
        assert time.monotonic() - started < 10, trap
        assert bash(sandbox, 'pwd; echo "$KEPT"')["stdout"] == "/w\na b\n", trap
    fingerprint = sandbox.state_fingerprint()
    assert fingerprint is not None and fingerprint.processes == 0
