"""A tiny Harbor task for the lab: the oracle's solve.sh works for SOLVE_SECONDS, then writes an
answer and some agent logs (nested, with modes and a link); tests/test.sh checks the answer and
writes the reward and a report. Written as Harbor's task layout (task.toml, instruction.md,
environment/, solution/, tests/).

Each run of solve.sh appends a line to /probe/solve-runs when the environment binds a probe
folder there (harbor_local's `probe_dir`): outside the sandbox's state, it counts the runs.
"""

from __future__ import annotations

from pathlib import Path

SOLVE_SECONDS = 4

TASK_TOML = """\
schema_version = "1.4"

[metadata]
difficulty = "easy"

[verifier]
timeout_sec = 60.0

[agent]
timeout_sec = 60.0

[environment]
build_timeout_sec = 60.0
"""

INSTRUCTION = "Write the answer `42` to /app/answer.txt.\n"

DOCKERFILE = "FROM debian:bookworm-slim\nLABEL lab.run={label}\nWORKDIR /app\n"

SOLVE = f"""\
#!/bin/bash
set -e
if [ -d /probe ]; then echo run >> /probe/solve-runs; fi
echo "thinking for {SOLVE_SECONDS} s"
sleep {SOLVE_SECONDS}
echo 42 > /app/answer.txt
mkdir -p /logs/agent/notes
printf 'step 1: wrote the answer\\n' > /logs/agent/notes/steps.txt
chmod 600 /logs/agent/notes/steps.txt
ln -sf notes/steps.txt /logs/agent/latest-steps
echo "solved"
"""

TEST = """\
#!/bin/bash
mkdir -p /logs/verifier/details
if [ "$(cat /app/answer.txt 2>/dev/null)" = "42" ]; then
  echo 1 > /logs/verifier/reward.txt
  echo "answer ok" > /logs/verifier/details/report.txt
else
  echo 0 > /logs/verifier/reward.txt
  echo "answer missing or wrong" > /logs/verifier/details/report.txt
fi
chmod 640 /logs/verifier/details/report.txt
echo "checked /app/answer.txt"
"""

FILES = {
    "task.toml": (TASK_TOML, 0o644),
    "instruction.md": (INSTRUCTION, 0o644),
    "environment/Dockerfile": (DOCKERFILE, 0o644),
    "solution/solve.sh": (SOLVE, 0o755),
    "tests/test.sh": (TEST, 0o755),
}


def write_task(directory: Path, label: str = "lab") -> Path:
    """Write the task into `directory` (created) and return it. `label` goes into the
    environment's definition: another label, another environment_id (and tvcache task)."""
    for name, (text, mode) in FILES.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.format(label=label) if name == "environment/Dockerfile" else text)
        path.chmod(mode)
    return directory
