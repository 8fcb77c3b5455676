"""The bash tool's shell session. Each command runs in a fresh shell (`docker exec`) that first
restores the previous call's working directory and exported variables from a state folder inside
the container (/.tvcache), and saves them again on exit. Because the state lives in the
container's filesystem, `commit` captures it: a fork resumes the same shell session. The shell
starts from an empty environment (`env -i`), so a variable the agent unsets stays unset."""

from __future__ import annotations

import docker

from ..base import SandboxError

STATE_DIR = "/.tvcache"
SESSION_FILES = ("env.sh", "cwd")  # what calls keep of the shell session
# One argument of execve is capped at 128 KiB by Linux.
MAX_COMMAND_BYTES = 128 * 1024 - 1
# Run once in a fresh sandbox: seed the session state from the image's environment and working
# directory, and say whether bash exists (the busybox image only has ash).
# The variables are exported in the calls' shell's own syntax, so a first call changes nothing.
_INIT_SCRIPT = f"""mkdir -p {STATE_DIR} && pwd > {STATE_DIR}/cwd && if __tvc_bash=$(command -v bash); then
"$__tvc_bash" -c 'unset OLDPWD; export -p' > {STATE_DIR}/env.sh && echo "$__tvc_bash"; else export -p > {STATE_DIR}/env.sh; fi"""
# Run per call as `env -i SHELL -c CALL_SCRIPT SHELL COMMAND`, by a `docker exec` of its own or by
# the container's session agent (agent.py). Docker starts each exec as a session and group leader,
# the agent starts it under setsid: a timeout kills that session from the host (procs.py).
CALL_SCRIPT = f""". {STATE_DIR}/env.sh
IFS= read -r __tvc_cwd < {STATE_DIR}/cwd
if [ "${{OLDPWD+set}}" ]; then __tvc_old=$OLDPWD; else unset __tvc_old; fi
cd "$__tvc_cwd" 2>/dev/null || cd /
if [ "${{__tvc_old+set}}" ]; then OLDPWD=$__tvc_old; else unset OLDPWD; fi
trap '__tvc_rc=$?; export -p > {STATE_DIR}/env.sh; pwd > {STATE_DIR}/cwd; exit $__tvc_rc' EXIT
__tvc_cmd=$1
set --
eval "unset __tvc_cwd __tvc_cmd __tvc_old
$__tvc_cmd"
"""


def call_argv(shell: str, command: str) -> list[str]:
    return ["env", "-i", shell, "-c", CALL_SCRIPT, shell, command]


def session_init(api: docker.APIClient, container_id: str) -> str:
    """Writes the first session state; returns the shell that calls will run under."""
    exec_id = api.exec_create(container_id, ["/bin/sh", "-c", _INIT_SCRIPT])["Id"]
    out = api.exec_start(exec_id).decode("utf-8", errors="replace").strip()
    if api.exec_inspect(exec_id)["ExitCode"] != 0:
        raise SandboxError(f"could not initialise the shell session: {out[-500:]}")
    return out or "/bin/sh"


def shell_probe(api: docker.APIClient, container_id: str) -> str:
    """The shell calls run under in a sandbox whose image does not say (bash where it exists)."""
    exec_id = api.exec_create(container_id, ["/bin/sh", "-c", "command -v bash || true"])["Id"]
    return api.exec_start(exec_id).decode("utf-8", errors="replace").strip() or "/bin/sh"
