"""The terminal workload: docker tasks in the spirit of terminal-bench, on tvcache/debian:bookworm.

Each task is a setup prefix (write a project, a slow dependency step, a first build or test run)
then a repair loop: inspection commands, one of several fixes (some wrong, so the rollout retries),
rebuild, rerun the tests. A seeded policy per task keeps the usual setup most of the time and
branches later. Outputs are deterministic: no timestamps or timings are printed (the Python test
runner is our own), git commits use fixed author and committer dates, and the slow "dependency
download" steps are sleeps that write a marker (sandboxes have no network). Every `bash` call is
declared state-changing; in tool-server mode the service observes which ones changed nothing
(inspections, a rerun of the tests) and keys later calls without them.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from sandboxes.backends import backend_for
from sandboxes.handles import sandbox_config
from tvclient import ToolExecutionEnvironment

from .workload import VERIFY_STEP, Call, ReplayTask, Workload

IMAGE = "tvcache/debian:bookworm"
LABELS = {"tvcache.replay": "terminal"}


def bash(command: str) -> Call:
    return {"tool": "bash", "args": {"command": command}}


def heredoc(path: str, text: str) -> str:
    return f"cat > {path} <<'EOF'\n{text.strip()}\nEOF\necho wrote {path}"


# ---------------------------------------------------------------------------------------------
# A local docker sandbox as a tvclient environment (client mode and the no-cache arm)


class _Image:
    """A snapshot image shared by lazy forks; deleted with its last user."""

    def __init__(self, backend, ref: str, size_bytes: int):
        self.backend, self.ref, self.size_bytes = backend, ref, size_bytes
        self._users = 1
        self._lock = threading.Lock()

    def retain(self) -> _Image:
        with self._lock:
            self._users += 1
        return self

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self.backend.delete_snapshot(self.ref)


def lab_config(session: bool):
    """The service's sandbox configuration for the lab's own containers, which stand for a
    trainer's: each bash call run by a `docker exec` of its own, or (`session`) by the session
    agent tool-server mode uses (`--direct-calls session`: misses measured against both)."""
    config = sandbox_config()
    return replace(config, docker=replace(config.docker, session=session))


class DockerEnvironment(ToolExecutionEnvironment):
    """A container of the service's own docker backend. fork() commits an image and returns an
    environment that starts its container from it on first use, so frozen snapshots cost an
    image, not a running container."""

    backend = "docker"

    def __init__(self, env: dict[str, Any], image: _Image | None = None, *, session: bool = False):
        self._session = session
        self._docker = backend_for("docker", lab_config(session))
        self._env = env
        self._image = image
        self._sandbox = None
        self.size_bytes = image.size_bytes if image else 0

    def start(self) -> None:
        if self._image is None:
            self._sandbox = self._docker.start(self._env, labels=LABELS)

    def _running(self):
        if self._sandbox is None:
            assert self._image is not None
            self._sandbox = self._docker.fork(self._image.ref, self._env, labels=LABELS)
        return self._sandbox

    def execute(self, call: Call) -> dict[str, Any]:  # the no-cache arm: nothing observed
        return self._running().execute(call["tool"], call["args"])

    def execute_observed(self, call: Call) -> tuple[dict[str, Any], bool | None]:
        return self._running().execute_observed(call["tool"], call["args"])

    def file_times(self) -> Mapping[str, int] | None:
        """The times of what the last call changed: the entries whose ctime moved during it, as
        the service keeps them of its own sandboxes (StateDigest.times: paths as their bytes in
        Latin-1, None when not kept)."""
        state = self._sandbox.state_fingerprint() if self._sandbox is not None else None
        return None if state is None else state.times

    def restore_file_times(self, times: Mapping[str, int]) -> None:
        self._running().restore_file_times(times)

    def fork(self) -> DockerEnvironment:
        if self._sandbox is None and self._image is not None:
            return DockerEnvironment(self._env, self._image.retain(), session=self._session)
        info = self._running().snapshot(labels=LABELS)
        return DockerEnvironment(self._env, _Image(self._docker, info.ref, info.size_bytes), session=self._session)

    def stop(self) -> None:
        sandbox, self._sandbox = self._sandbox, None
        image, self._image = self._image, None
        if sandbox is not None:
            sandbox.stop()
        if image is not None:
            image.release()


# ---------------------------------------------------------------------------------------------
# Tasks


@dataclass(frozen=True)
class Fix:
    command: str
    good: bool


@dataclass(frozen=True)
class TerminalTask:
    name: str
    setup: tuple[str, ...]
    alternatives: dict[int, str]  # setup step -> the variant a minority of rollouts take
    inspections: tuple[str, ...]
    fixes: tuple[Fix, ...]
    verify: tuple[str, ...]
    finish: tuple[str, ...]


CALC_C = r"""
#include "calc.h"
int add(int a, int b) { return a + b; }
int mul(int a, int b) { return a + b; }
int power(int base, int exp) { int r = 1; for (int i = 0; i < exp; i++) r = mul(r, base); return r; }
"""
CALC_H = "int add(int a, int b);\nint mul(int a, int b);\nint power(int base, int exp);"
MAIN_C = r"""
#include <stdio.h>
#include "calc.h"
int main(void) {
    int fails = 0;
    if (add(2, 3) != 5) { printf("FAIL add\n"); fails++; }
    if (mul(4, 5) != 20) { printf("FAIL mul\n"); fails++; }
    if (power(2, 10) != 1024) { printf("FAIL power\n"); fails++; }
    printf("%d failures\n", fails);
    return fails != 0;
}
"""
MAKEFILE = "CFLAGS ?= -O2 -Wall\ncalc_test: main.o calc.o\n\t$(CC) $(CFLAGS) -o $@ $^\n%.o: %.c calc.h\n\t$(CC) $(CFLAGS) -c $<\nclean:\n\trm -f *.o calc_test"

STATS_PY = """
def mean(xs):
    return sum(xs) / (len(xs) - 1)

def median(xs):
    s = sorted(xs)
    return s[len(s) // 2]

def variance(xs):
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)
"""
TESTS_PY = """
import stats

def test_mean():
    assert stats.mean([1, 2, 3, 4]) == 2.5

def test_median_odd():
    assert stats.median([3, 1, 2]) == 2

def test_median_even():
    assert stats.median([4, 1, 3, 2]) == 2.5

def test_variance():
    assert stats.variance([1, 2, 3, 4]) == 1.25
"""
RUNNER_PY = """
import sys, traceback, test_stats
names = sorted(n for n in dir(test_stats) if n.startswith("test_"))
failed = 0
for name in names:
    try:
        getattr(test_stats, name)()
        print("PASS", name)
    except Exception as exc:
        failed += 1
        print("FAIL", name, type(exc).__name__)
print(f"{len(names) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
"""
GIT_ENV = (
    "export GIT_AUTHOR_NAME=agent GIT_AUTHOR_EMAIL=agent@example.com GIT_COMMITTER_NAME=agent "
    "GIT_COMMITTER_EMAIL=agent@example.com GIT_AUTHOR_DATE='2024-01-01T00:00:00+0000' "
    "GIT_COMMITTER_DATE='2024-01-01T00:00:00+0000'; echo env set"
)

TASKS = [
    TerminalTask(
        name="c-build",
        setup=(
            "mkdir -p /srv/calc && cd /srv/calc && pwd",
            heredoc("calc.c", CALC_C),
            heredoc("calc.h", CALC_H),
            heredoc("main.c", MAIN_C),
            heredoc("Makefile", MAKEFILE),
            "sleep 2 && mkdir -p vendor && echo 'fetched 3 dependencies' | tee vendor/MANIFEST",
            "make 2>&1",
            "./calc_test; echo exit=$?",
        ),
        alternatives={6: "make CFLAGS='-O0 -g -Wall' 2>&1"},
        inspections=("grep -n 'return' calc.c", "ls", "cat calc.h", "make -n 2>&1 | head -5", "wc -l *.c"),
        fixes=(
            Fix("sed -i 's/return a + b; }$/return a * b; }/' calc.c && echo patched", False),
            Fix("sed -i '/int mul/s/a + b/a * b/' calc.c && echo patched", True),
            Fix(
                "sed -i 's/int mul(int a, int b) { return a + b; }/int mul(int a, int b) { return a * b; }/' calc.c"
                " && echo patched",
                True,
            ),
            Fix("sed -i 's/r = mul(r, base)/r = r * base/' calc.c && echo patched", False),
        ),
        verify=("make 2>&1", "./calc_test; echo exit=$?"),
        finish=("git --version | cut -d' ' -f1-2", "make clean && ls"),
    ),
    TerminalTask(
        name="py-tests",
        setup=(
            "mkdir -p /srv/app && cd /srv/app && pwd",
            heredoc("stats.py", STATS_PY),
            heredoc("test_stats.py", TESTS_PY),
            heredoc("run_tests.py", RUNNER_PY),
            "sleep 2 && mkdir -p deps && echo 'installed 4 requirements' | tee deps/INSTALLED",
            "python3 -m compileall -q . && echo compiled",
            "python3 run_tests.py; echo exit=$?",
        ),
        alternatives={5: "python3 -B -c 'import stats' && echo imported"},
        inspections=(
            "grep -n 'def ' stats.py",
            "python3 -c 'import stats; print(stats.mean([2, 4]))'",
            "sed -n '1,4p' stats.py",
            "ls *.py",
        ),
        fixes=(
            Fix("sed -i 's/(len(xs) - 1)/len(xs)/' stats.py && echo patched mean", True),
            Fix(
                "sed -i 's/return s\\[len(s) \\/\\/ 2\\]/return (s[(len(s) - 1) \\/\\/ 2] + s[len(s) \\/\\/ 2]) / 2/'"
                " stats.py && echo patched median",
                True,
            ),
            Fix("sed -i 's/len(xs) - 1/len(xs) + 0/' stats.py && echo patched mean", True),
            Fix("sed -i 's/\\/ len(xs)$/\\/ (len(xs) - 1)/' stats.py && echo patched variance", False),
        ),
        verify=("python3 run_tests.py; echo exit=$?",),
        finish=("python3 -c 'import stats; print(stats.variance([1, 2, 3, 4]))'",),
    ),
    TerminalTask(
        name="git-ops",
        setup=(
            GIT_ENV,
            "mkdir -p /srv/repo && cd /srv/repo && git init -q -b main && echo initialised",
            heredoc("README.md", "# demo\n\nA small repository.") + " && git add -A && git commit -q -m init && "
            "git log --oneline",
            'for i in $(seq 1 25); do echo "line $i" >> notes.txt; git add notes.txt; git commit -q -m "note $i"; '
            "done; sleep 1; git rev-list --count HEAD",
            "git checkout -q -b feature && echo 'feature work' >> README.md && git commit -qam 'feature' && "
            "git log --oneline -3",
        ),
        alternatives={
            4: "git checkout -q -b feature && echo 'other work' >> README.md && git commit -qam 'feature' "
            "&& git log --oneline -3"
        },
        inspections=("git status --short", "git log --oneline -5", "git diff main --stat", "git branch"),
        fixes=(
            Fix("git checkout -q main && git merge -q --no-ff -m merge feature && git log --oneline -3", True),
            Fix(
                "git checkout -q main && echo 'main work' >> README.md && git commit -qam 'main' && "
                "git merge -q -m merge feature 2>&1; git status --short",
                False,
            ),
            Fix("git rebase -q main 2>&1; git log --oneline -3", True),
            Fix(
                "git merge --abort 2>/dev/null; git checkout -q --theirs README.md 2>/dev/null; git add -A && "
                "git commit -qm resolve 2>&1; git log --oneline -2",
                True,
            ),
        ),
        verify=("git log --oneline | wc -l", "git status --short | wc -l"),
        finish=("git rev-parse --short HEAD",),
    ),
    TerminalTask(
        name="config-edit",
        setup=(
            "mkdir -p /srv/site/conf && cd /srv/site && pwd",
            heredoc("conf/app.ini", "[server]\nport = 8080\nworkers = 2\n\n[db]\nhost = localhost\npool = 5"),
            heredoc(
                "check.py",
                "import configparser, sys\nc = configparser.ConfigParser(); c.read('conf/app.ini')\n"
                "ok = c['server'].getint('workers') >= 4 and c['db'].getint('pool') >= 10\n"
                "print('config ok' if ok else 'config bad'); sys.exit(0 if ok else 1)",
            ),
            "sleep 2 && mkdir -p data && echo 'provisioned database' | tee data/READY",
            "python3 check.py; echo exit=$?",
        ),
        alternatives={3: "sleep 2 && mkdir -p data && echo 'provisioned database (retry)' | tee data/READY"},
        inspections=("cat conf/app.ini", "grep -n '=' conf/app.ini", "ls conf"),
        fixes=(
            Fix("sed -i 's/workers = 2/workers = 4/' conf/app.ini && echo edited", False),
            Fix("sed -i 's/workers = 2/workers = 4/; s/pool = 5/pool = 10/' conf/app.ini && echo edited", True),
            Fix("sed -i 's/pool = 5/pool = 20/' conf/app.ini && echo edited", False),
            Fix(
                "printf '[server]\\nport = 8080\\nworkers = 8\\n\\n[db]\\nhost = localhost\\npool = 16\\n' > "
                "conf/app.ini && echo rewritten",
                True,
            ),
        ),
        verify=("python3 check.py; echo exit=$?",),
        finish=("md5sum conf/app.ini | cut -c1-12",),
    ),
]


class TerminalWorkload(Workload):
    name = "terminal"
    fault_kinds = ("timeout", "error_after", "sandbox_death")
    P_ALTERNATIVE = 0.15  # a rollout takes a setup variant (an early branch)
    P_INSPECT = 0.6  # inspect before a fix
    MAX_ATTEMPTS = 3

    def __init__(
        self, *, tasks: int, rollouts: int, seed: int, names: list[str] | None = None, direct_calls: str = "exec"
    ):
        if names:
            unknown = set(names) - {t.name for t in TASKS}
            if unknown:
                raise ValueError(f"unknown terminal tasks {sorted(unknown)}")
            self.specs = [t for t in TASKS if t.name in names]
        elif tasks > len(TASKS):
            raise ValueError(f"the terminal workload has {len(TASKS)} tasks")
        else:
            self.specs = TASKS[:tasks]
        self.n_rollouts = rollouts
        self.seed = seed
        self.direct_calls = direct_calls

    def describe(self) -> dict[str, Any]:
        return {
            "image": IMAGE,
            "p_alternative_setup": self.P_ALTERNATIVE,
            "p_inspect": self.P_INSPECT,
            "max_fix_attempts": self.MAX_ATTEMPTS,
            "direct_calls": self.direct_calls,
        }

    def tasks(self) -> list[ReplayTask]:
        server_env = {"backend": "docker", "image": IMAGE, "network": False}
        out = []
        for spec in self.specs:
            client_env = {
                "backend": "external",
                "workload": "terminal",
                "task": spec.name,
                "image": IMAGE,
                "version": 1,
            }
            out.append(
                ReplayTask(
                    spec.name,
                    {},
                    client_env,
                    server_env,
                    lambda: DockerEnvironment(
                        {"backend": "docker", "image": IMAGE, "network": False}, session=self.direct_calls == "session"
                    ),
                )
            )
        return out

    def timeout_call(self, call: Call, timeout_s: float) -> Call | None:
        """The slow "dependency" steps start with a 2 s sleep: a timeout under that kills them
        mid-run, inside the sleep, before anything of theirs is written, on any machine."""
        command = call["args"]["command"]
        if not command.startswith("sleep 2 ") or timeout_s >= 2:
            return None
        return {"tool": "bash", "args": {"command": command, "timeout_s": timeout_s}}

    def rollouts(self, task: ReplayTask, epoch: int) -> list[list[Call]]:
        return [[bash(command) for command, _ in rollout] for rollout in self._rollouts(task, epoch)]

    def steps(self, task: ReplayTask, epoch: int) -> list[list[str | None]]:
        """VERIFY_STEP for the commands of the task's `verify` after each fix (the last run of
        them in a rollout is the final verification, which computes the reward)."""
        return [[step for _, step in rollout] for rollout in self._rollouts(task, epoch)]

    def _rollouts(self, task: ReplayTask, epoch: int) -> list[list[tuple[str, str | None]]]:
        spec = next(s for s in self.specs if s.name == task.name)
        return [
            self._rollout(spec, random.Random(f"{self.seed}-{spec.name}-{epoch}-{index}"))
            for index in range(self.n_rollouts)
        ]

    def _rollout(self, spec: TerminalTask, rng: random.Random) -> list[tuple[str, str | None]]:
        """(command, step label) pairs."""
        commands = list(spec.setup)
        for step, variant in spec.alternatives.items():
            if rng.random() < self.P_ALTERNATIVE:
                commands[step] = variant
        labelled: list[tuple[str, str | None]] = [(c, None) for c in commands]
        for _ in range(self.MAX_ATTEMPTS):
            if rng.random() < self.P_INSPECT:
                labelled.extend((c, None) for c in rng.sample(spec.inspections, rng.randint(1, 2)))
            fix = rng.choice(spec.fixes)
            labelled.append((fix.command, None))
            labelled.extend((c, VERIFY_STEP) for c in spec.verify)
            if fix.good and rng.random() < 0.8:
                break
        labelled.extend((c, None) for c in spec.finish[: rng.randint(0, len(spec.finish))])
        return labelled
