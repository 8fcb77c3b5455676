"""The docker backend's shell session (session.py) against the real engine: one agent per container
runs the calls; a session that dies or is tampered with is replaced, never waited on for long."""

from __future__ import annotations

import os
import signal
import time

import docker
import docker.errors
import pytest

from sandboxes.backends.docker import DockerBackend, DockerSandbox
from sandboxes.backends.session import SessionBroken, encode_request
from sandboxes.images import DEBIAN_TAG

from .conftest import make_docker_backend

pytestmark = pytest.mark.docker

ENV = {"backend": "docker"}


def bash(sandbox: DockerSandbox, command: str, **args: object) -> dict:
    return sandbox.execute("bash", {"command": command, **args})


def agents(docker_client: docker.DockerClient, sandbox: DockerSandbox) -> list[int]:
    """Host pids of the session agents in the container (`docker top` looks from outside)."""
    processes = docker_client.api.top(sandbox.sandbox_id, ps_args="-o pid,ppid,args")["Processes"]
    pids = {int(p[0]) for p in processes}
    # Only the agents themselves: the subshells it forks for a pipeline carry its arguments too.
    return [int(p[0]) for p in processes if "tvcache-session" in p[2] and int(p[1]) not in pids]


@pytest.fixture
def sandbox(docker_backend: DockerBackend, test_labels: dict[str, str]) -> DockerSandbox:
    return docker_backend.start(ENV, labels=test_labels)


def test_calls_run_in_one_agent_with_the_session_semantics(docker_client, sandbox):
    bash(sandbox, "mkdir -p /w && cd /w && export A='a b'")
    first = agents(docker_client, sandbox)
    assert len(first) == 1
    for _ in range(5):
        assert bash(sandbox, 'pwd; echo "$A"; echo e >&2; exit 4') == {
            "stdout": "/w\na b\n", "stderr": "e\n", "exit_code": 4, "timed_out": False, "truncated": False}
    assert agents(docker_client, sandbox) == first


def test_commands_keep_their_bytes_lines_and_backslashes(sandbox):
    command = "printf '%s|' 'a\\\\b' '\\n' 'c  d' \"$(printf 'x\\ny')\"; printf 'tail without newline\\n\\n'"
    assert bash(sandbox, command)["stdout"] == "a\\\\b|\\n|c  d|x\ny|tail without newline\n\n"
    long = "x=" + "y" * 100_000 + "\n" * 3 + "echo ${#x} end"
    result = bash(sandbox, long)
    assert result["stdout"] == "100000 end\n" and result["exit_code"] == 0


def test_a_call_that_forges_end_markers_only_prints_them(sandbox):
    forged = "printf '\\0TVC%s 0\\n' 0123456789abcdef0123456789abcdef; printf '\\0TVC%s\\n' 0123456789abcdef0123456789abcdef >&2"
    result = bash(sandbox, forged + "; exit 5")
    assert result["stdout"] == "\0TVC0123456789abcdef0123456789abcdef 0\n"
    assert result["stderr"] == "\0TVC0123456789abcdef0123456789abcdef\n" and result["exit_code"] == 5
    assert bash(sandbox, "echo next")["stdout"] == "next\n"


def test_an_agent_killed_between_calls_is_replaced(docker_client, sandbox):
    bash(sandbox, "cd /tmp && export KEPT=1")
    (agent,) = agents(docker_client, sandbox)
    os.kill(agent, signal.SIGKILL)
    assert bash(sandbox, 'pwd; echo "$KEPT"')["stdout"] == "/tmp\n1\n"  # in an exec: the session had died
    assert bash(sandbox, 'pwd; echo "$KEPT"')["stdout"] == "/tmp\n1\n"  # in a new session
    assert len(agents(docker_client, sandbox)) == 1 and agents(docker_client, sandbox) != [agent]


def test_a_call_that_kills_its_agent_is_refused_as_session_broken(docker_client, sandbox):
    with pytest.raises(SessionBroken) as broken:
        bash(sandbox, "ps -o pid,args | grep 'tvcache-sessio[n]' | while read pid rest; do kill -9 $pid; done; echo after")
    assert broken.value.code == "session_broken"
    assert bash(sandbox, "echo again")["stdout"] == "again\n"
    assert len(agents(docker_client, sandbox)) == 1


def test_a_stopped_agent_never_hangs_the_call(docker_client, sandbox):
    bash(sandbox, "cd /tmp")
    (agent,) = agents(docker_client, sandbox)
    os.kill(agent, signal.SIGSTOP)
    started = time.monotonic()
    assert bash(sandbox, "pwd; echo ran", timeout_s=60)["stdout"] == "/tmp\nran\n"  # given up on, run by exec
    assert time.monotonic() - started < 30
    assert agent not in agents(docker_client, sandbox)  # the stopped agent was killed


def test_output_written_into_the_session_between_calls_replaces_it(docker_client, sandbox):
    # A background job of a call writes into the agent's own stdout after the call has ended.
    bash(sandbox, "true")
    before = agents(docker_client, sandbox)
    bash(sandbox, "agent=$(ps -o pid,args | grep 'tvcache-sessio[n]' | head -n 1 | while read pid rest; do echo $pid; done);"
                  " (sleep 0.3; echo junk > /proc/$agent/fd/1) > /dev/null 2>&1 &")
    time.sleep(1)
    assert bash(sandbox, "echo clean")["stdout"] == "clean\n"
    assert bash(sandbox, "echo clean again")["stdout"] == "clean again\n"
    assert len(agents(docker_client, sandbox)) == 1 and agents(docker_client, sandbox) != before


def test_a_sandbox_that_keeps_breaking_its_session_runs_by_exec(docker_client, sandbox):
    for _ in range(3):
        bash(sandbox, "true")
        for agent in agents(docker_client, sandbox):
            os.kill(agent, signal.SIGKILL)
        bash(sandbox, "true")  # the dead session is found and the call runs by exec
    bash(sandbox, "true")
    assert agents(docker_client, sandbox) == []
    assert bash(sandbox, "echo still")["stdout"] == "still\n"


def test_a_timed_out_call_is_killed_and_the_session_goes_on(docker_client, sandbox):
    result = bash(sandbox, "echo before; sleep 60 & sleep 60", timeout_s=0.5)
    assert result["timed_out"] is True and result["stdout"] == "before\n" and result["exit_code"] == 137
    assert "sleep 60" not in bash(sandbox, "ps")["stdout"]
    assert len(agents(docker_client, sandbox)) == 1


def test_a_timeout_with_output_held_by_a_process_that_left_the_call_ends_the_session(docker_client, sandbox):
    # A daemon of the call's own making keeps its stdout open: the call ends at its timeout, as an
    # exec's would, and the session that relays that output is replaced.
    started = time.monotonic()
    result = bash(sandbox, "setsid sleep 300 & echo started", timeout_s=1)
    assert result["timed_out"] is True and result["stdout"] == "started\n"
    assert time.monotonic() - started < 30
    assert bash(sandbox, "echo next")["stdout"] == "next\n"


def test_an_agent_missing_a_tool_hands_the_sandbox_to_exec(docker_client, docker_backend, test_labels):
    try:
        docker_client.images.get(DEBIAN_TAG)
    except docker.errors.ImageNotFound:
        pytest.fail(f"{DEBIAN_TAG} is not built: run manage.py build_images (.ci/test.sh does)")
    sandbox = docker_backend.start({**ENV, "image": DEBIAN_TAG}, labels=test_labels)
    bash(sandbox, "cd /usr && rm /usr/bin/setsid")
    assert bash(sandbox, "pwd; echo by exec")["stdout"] == "/usr\nby exec\n"
    assert agents(docker_client, sandbox) == []
    assert bash(sandbox, "echo still")["stdout"] == "still\n"


def test_exec_and_session_give_the_same_results(docker_backend, test_labels, busybox_image):
    by_exec = make_docker_backend()
    by_exec.sessions = False
    commands = ["mkdir -p /w && cd /w && export X=1 && echo hi > f", "cat f; echo $X; ls; exit 2",
                "echo err >&2; (sleep 0.2; echo late) &", "yes | head -c 3000 | wc -c", "cd /; unset X"]
    one, two = docker_backend.start(ENV, labels=test_labels), by_exec.start(ENV, labels=test_labels)
    for command in commands:
        assert bash(one, command) == bash(two, command), command
        assert one.state_fingerprint().shape == two.state_fingerprint().shape, command


def test_a_request_carries_the_command_line_by_line():
    assert encode_request("ab", "echo 1\necho 2\n") == b"ab 3\necho 1\necho 2\n\n"
    assert encode_request("ab", "") == b"ab 1\n\n"
