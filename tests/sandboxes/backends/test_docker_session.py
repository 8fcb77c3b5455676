"""The docker backend's session agent (docker/agent.py) against the real engine: one agent per
container runs the calls as an exec would; an agent that dies, stalls or is tampered with is
replaced or refused, never trusted with a result."""

from __future__ import annotations

import os
import signal
import time

import docker
import docker.errors
import pytest

from sandboxes.backends.base import SandboxGone
from sandboxes.backends.docker import DockerBackend, DockerSandbox
from sandboxes.backends.docker.agent import CallFrames, ProtocolError, SessionBroken, encode_request
from sandboxes.backends.docker.execstream import Output
from sandboxes.images import DEBIAN_TAG
from tests.support.docker import make_docker_backend

pytestmark = pytest.mark.docker

ENV = {"backend": "docker"}


def bash(sandbox: DockerSandbox, command: str, **args: object) -> dict:
    return sandbox.execute("bash", {"command": command, **args})


def agents(docker_client: docker.DockerClient, sandbox: DockerSandbox) -> list[int]:
    """Host pids of the session agents in the container (`docker top` looks from outside)."""
    processes = docker_client.api.top(sandbox.sandbox_id, ps_args="-o pid,ppid,args")["Processes"]
    pids = {int(p[0]) for p in processes}
    # The agents themselves: the subshells they fork carry their arguments too.
    return [int(p[0]) for p in processes if "tvcache-session" in p[2] and int(p[1]) not in pids]


@pytest.fixture(params=["busybox", "debian"])
def image(request, busybox_image, docker_client) -> str:
    if request.param == "busybox":
        return busybox_image
    try:
        docker_client.images.get(DEBIAN_TAG)
    except docker.errors.ImageNotFound:
        pytest.fail(f"{DEBIAN_TAG} is not built: run manage.py build_images (.ci/test.sh does)")
    return DEBIAN_TAG


@pytest.fixture
def sandbox(docker_backend: DockerBackend, test_labels: dict[str, str], image: str) -> DockerSandbox:
    return docker_backend.start({**ENV, "image": image}, labels=test_labels)


def pids_of(pattern: str) -> str:
    """A shell loop printing the pids whose command line matches a `case` pattern (no ps in debian)."""
    return (
        f'for d in /proc/[0-9]*; do case "$(tr "\\0" " " < $d/cmdline 2>/dev/null)" in {pattern}) echo ${{d#/proc/}};;'
        " esac; done"
    )


AGENTS = pids_of("*tvcache-sessio[n]*")  # the pattern does not match the call's own command line

PARITY = [
    "mkdir -p /w && cd /w && export A='a b' B=2; echo hi > f",
    'pwd; echo "$A $B"; echo e >&2; exit 4',
    "unset A; echo ${A-unset} ${B-unset}; cd /tmp",
    "pwd; ls /proc/self/fd | wc -l; grep -E '^Sig(Ign|Blk)' /proc/self/status; ps -o stat= -p $$ 2>/dev/null | cut -c1-2",
    "cat; read x; echo read=$?",  # stdin is /dev/null
    "printf 'no newline'; printf 'err no newline' >&2",
    "printf '%s|' 'a\\\\b' '\\n' \"$(printf 'x\\ny')\"\necho second line\n\n",
    "echo before; (sleep 0.3; echo late; echo late-err >&2) & echo after",  # the call ends with its writers
    "(sleep 0.5; touch /w/g) >/dev/null 2>&1 & exit 3",  # a straggler that writes after the call's end
    "while [ ! -e /w/g ]; do sleep 0.05; done; echo seen",  # its write is this call's change, in both
    "printf '\\0TVC%s 0\\n' 0123456789abcdef0123456789abcdef; printf '\\0TVC%s end\\n' x >&2; printf '\\0TVC'",
    "yes 0123456789 | head -c 300000",  # past the output cap
    "echo x; sleep 5; echo y",  # killed at its timeout
    "echo x >&2; kill -9 $$",
    "exit 200",
    "echo last; cat /w/f; ls /w",
]


def observed(sandbox: DockerSandbox, args: dict) -> tuple[dict, bool | None]:
    """A call's result, and whether the state changed since the last call ended: during the call,
    or before it by a process the last one left (the straggler below writes at either moment)."""
    result, changed = sandbox.execute_observed("bash", args)
    return result, changed or sandbox.state_drifted()


def test_session_and_exec_give_the_same_results(docker_client, test_labels, image):
    by_session, by_exec = make_docker_backend(), make_docker_backend(session=False)
    env = {**ENV, "image": image}
    one, two = by_session.start(env, labels=test_labels), by_exec.start(env, labels=test_labels)
    for command in PARITY:
        args = {"command": command, "timeout_s": 1}
        got, expected = observed(one, args), observed(two, args)
        assert got == expected, command
    assert one.state_fingerprint().shape == two.state_fingerprint().shape
    assert len(agents(docker_client, one)) == 1 and agents(docker_client, two) == []


def test_calls_run_in_one_agent(docker_client, sandbox):
    bash(sandbox, "cd /tmp && export KEPT=1")
    first = agents(docker_client, sandbox)
    assert len(first) == 1
    for _ in range(5):
        assert bash(sandbox, 'pwd; echo "$KEPT"')["stdout"] == "/tmp\n1\n"
    assert agents(docker_client, sandbox) == first


def test_a_timed_out_call_is_killed_with_its_tree_and_the_next_call_runs(docker_client, sandbox):
    result = bash(sandbox, "echo before; sleep 60 & sleep 60", timeout_s=0.5)
    assert result == {"stdout": "before\n", "stderr": "", "exit_code": 137, "timed_out": True, "truncated": False}
    assert bash(sandbox, pids_of("'sleep 60 '"))["stdout"] == ""
    assert bash(sandbox, "echo next")["stdout"] == "next\n"
    assert len(agents(docker_client, sandbox)) == 1


def test_a_flood_is_killed_and_the_next_call_runs(sandbox):
    result = bash(sandbox, "yes", timeout_s=30)
    assert result["truncated"] is True and result["timed_out"] is False and result["exit_code"] == 137
    assert len(result["stdout"]) == 64 * 1024
    assert bash(sandbox, "echo next") == {
        "stdout": "next\n",
        "stderr": "",
        "exit_code": 0,
        "timed_out": False,
        "truncated": False,
    }


def test_a_timed_out_call_whose_output_a_daemon_holds_ends_at_its_timeout(docker_client, sandbox):
    # A double-forked daemon keeps the call's stdout open and outlives the kill (as under exec): the
    # call ends after the kill's grace, and the agent relaying that output is replaced.
    started = time.monotonic()
    result = bash(sandbox, "(setsid sleep 300 &); echo started", timeout_s=1)
    assert result["timed_out"] is True and result["stdout"] == "started\n" and result["stderr"] == ""
    assert time.monotonic() - started < 30
    assert bash(sandbox, "echo next")["stdout"] == "next\n"
    assert len(agents(docker_client, sandbox)) == 1


def test_a_writer_left_by_a_timed_out_call_never_writes_into_the_next_call(docker_client, sandbox):
    result = bash(
        sandbox, "(setsid sh -c 'while :; do echo tick; echo tock >&2; sleep 0.05; done' &); sleep 30", timeout_s=1
    )
    assert result["timed_out"] is True and result["exit_code"] == 137
    assert set(result["stdout"].split()) == {"tick"} and set(result["stderr"].split()) == {"tock"}
    for _ in range(5):
        assert bash(sandbox, "echo next; sleep 0.1") == {
            "stdout": "next\n",
            "stderr": "",
            "exit_code": 0,
            "timed_out": False,
            "truncated": False,
        }
    assert len(agents(docker_client, sandbox)) == 1


@pytest.mark.parametrize(
    "kill",
    [
        "kill -9 $PPID",
        f"for p in $({AGENTS}); do kill -9 $p; done",
        f"for p in $({pids_of(chr(34) + 'cat ' + chr(34))}); do kill -9 $p; done; sleep 0.2",
    ],
)
def test_a_call_that_kills_its_agent_or_relays_is_refused(docker_client, sandbox, kill):
    bash(sandbox, "cd /tmp")
    with pytest.raises(SessionBroken) as broken:
        bash(sandbox, f"echo before; {kill}; echo after", timeout_s=10)
    assert broken.value.code == "session_broken"  # SandboxTampered: the service retires the sandbox
    assert bash(sandbox, "pwd; echo again")["stdout"] == "/tmp\nagain\n"


def test_a_call_that_kills_its_relays_then_times_out_is_refused(sandbox):
    with pytest.raises(SessionBroken):
        bash(
            sandbox,
            f"echo before; for p in $({pids_of(chr(34) + 'cat ' + chr(34))}); do kill -9 $p; done; sleep 30",
            timeout_s=1,
        )
    assert bash(sandbox, "echo again")["stdout"] == "again\n"


def test_a_call_that_kills_everything_kills_the_container_as_under_exec(docker_client, test_labels, image):
    for session in (True, False):
        sandbox = make_docker_backend(session=session).start({**ENV, "image": image}, labels=test_labels)
        bash(sandbox, "true")
        with pytest.raises(SandboxGone):
            bash(sandbox, "echo before; kill -9 -1; sleep 1; echo after", timeout_s=10)


def test_an_agent_killed_between_calls_is_replaced(docker_client, sandbox):
    bash(sandbox, "cd /tmp && export KEPT=1")
    (agent,) = agents(docker_client, sandbox)
    os.kill(agent, signal.SIGKILL)
    time.sleep(0.2)
    assert bash(sandbox, 'pwd; echo "$KEPT"')["stdout"] == "/tmp\n1\n"  # by exec: the agent had died
    assert bash(sandbox, 'pwd; echo "$KEPT"')["stdout"] == "/tmp\n1\n"  # in a new agent
    assert len(agents(docker_client, sandbox)) == 1 and agents(docker_client, sandbox) != [agent]


def test_a_stopped_agent_is_given_up_and_the_call_runs_once_by_exec(docker_client, sandbox):
    bash(sandbox, "cd /tmp")
    (agent,) = agents(docker_client, sandbox)
    os.kill(agent, signal.SIGSTOP)
    assert bash(sandbox, "echo ran >> /tmp/count; pwd", timeout_s=60)["stdout"] == "/tmp\n"
    assert agent not in agents(docker_client, sandbox)
    assert bash(sandbox, "cat /tmp/count")["stdout"] == "ran\n"


def test_output_written_into_the_agent_between_calls_replaces_it(docker_client, sandbox):
    bash(sandbox, "true")
    (before,) = agents(docker_client, sandbox)
    bash(sandbox, f"for p in $({AGENTS}); do (sleep 0.3; echo junk > /proc/$p/fd/5) >/dev/null 2>&1 & done")
    time.sleep(1)
    assert bash(sandbox, "echo clean") == {
        "stdout": "clean\n",
        "stderr": "",
        "exit_code": 0,
        "timed_out": False,
        "truncated": False,
    }
    assert bash(sandbox, "echo clean again")["stdout"] == "clean again\n"
    assert len(agents(docker_client, sandbox)) == 1 and agents(docker_client, sandbox) != [before]


def test_an_agent_missing_a_tool_hands_the_sandbox_to_exec(docker_client, docker_backend, test_labels):
    sandbox = docker_backend.start({**ENV, "image": DEBIAN_TAG}, labels=test_labels)
    bash(sandbox, "cd /usr && rm /usr/bin/setsid")
    assert bash(sandbox, "pwd; echo by exec")["stdout"] == "/usr\nby exec\n"
    assert agents(docker_client, sandbox) == []
    assert bash(sandbox, "echo still")["stdout"] == "still\n"


def test_session_off_runs_every_call_by_exec(docker_client, test_labels, busybox_image):
    sandbox = make_docker_backend(session=False).start(ENV, labels=test_labels)
    assert bash(sandbox, "echo hi")["stdout"] == "hi\n"
    assert agents(docker_client, sandbox) == []


NONCE = "0123456789abcdef0123456789abcdef"


def frames_of(*chunks: tuple[int, bytes]) -> CallFrames:
    frames = CallFrames(Output(1 << 20), NONCE)
    for stream, data in chunks:
        frames.add(stream, data)
    return frames


def test_markers_split_across_frames_are_found_and_the_output_kept_whole():
    mark = b"\0TVC" + NONCE.encode()
    stream = [
        (1, b"out\0TV"),
        (2, mark[:10]),
        (2, mark[10:] + b" start\nerr"),
        (1, b"C"),
        (1, mark[:7]),
        (1, mark[7:] + b" c3\nmore"),
        (1, mark + b" s\nexport A='1'\n" + mark[:5]),
        (1, mark[5:] + b" end o0 e0 \n"),
        (2, mark + b" end\n"),
    ]
    frames = frames_of(*stream)
    assert frames.finished and frames.relays_ok and frames.exit_code == 3
    assert frames.output.text(1) == "out\0TVCmore" and frames.output.text(2) == "err"
    assert frames.session == b"export A='1'\n"  # the session the call's shell handed back, out of the output


@pytest.mark.parametrize(
    "chunks",
    [
        [(2, b"stderr before the start")],
        [(2, b"\0TVC" + NONCE.encode() + b" start\n"), (1, b"\0TVC" + NONCE.encode() + b" end o0 e0 \n")],  # no status
        [(2, b"\0TVC" + NONCE.encode() + b" start\n"), (2, b"\0TVC" + NONCE.encode() + b" end\nafter the end")],
        [(1, b"\0TVC" + NONCE.encode() + b" c0\n\0TVC" + NONCE.encode() + b" c1\n")],
        [(1, b"\0TVC" + NONCE.encode() + b" c0\n\0TVC" + NONCE.encode() + b" end o0 e0 \n")],  # no session block
        [(1, b"\0TVC" + NONCE.encode() + b" s\n")],  # a session before the call's status
    ],
)
def test_anything_out_of_protocol_is_refused(chunks):
    with pytest.raises(ProtocolError):
        frames_of(*chunks)


def test_a_failed_relay_is_seen():
    mark = b"\0TVC" + NONCE.encode()
    frames = frames_of(
        (2, mark + b" start\n"),
        (1, mark + b" c0\n" + mark + b" s\n" + mark + b" end e137 o0 \n"),
        (2, mark + b" end\n"),
    )
    assert frames.finished and not frames.relays_ok and frames.session is None


def test_a_request_carries_the_command_whole():
    assert encode_request("ab", "echo 1\necho 2\n", None) == b"ab\necho 1\necho 2\n\0.\n"
    assert encode_request("ab", "", b"export A='1'\n") == b"ab\n\0" + b"1\nexport A='1'\n\0"
    assert encode_request("ab", "", b"x" * 70_000).count(b"\0") == 3  # the command, and the session in two chunks


def test_a_long_command_of_many_lines_runs_in_the_agent(docker_client, sandbox):
    bash(sandbox, "true")
    before = agents(docker_client, sandbox)
    command = "x=1\n" * 30_000 + "echo done"  # 120 KB: read at once, not line by line
    assert bash(sandbox, command)["stdout"] == "done\n"
    assert agents(docker_client, sandbox) == before  # not given up for exec
