"""The bash tool's shell session: each command runs in a fresh shell (from an empty environment,
`env -i`, so that a variable the agent unsets stays unset) that first takes the previous call's
working directory and exported variables, and hands them back when it exits.

The session is kept out of the sandbox, where no command can touch it (docs/design/state.md): the
host holds it (`Session`: one text, the `export -p` of the call's shell with the working directory
as the variable __TVC_CWD), sends it with each call (as arguments of the call's shell) and gets the
new one back on a channel of the call's own: at exit the call's shell writes it to its parent's
descriptor 7 (`/proc/$PPID/fd/7`), a pipe that the parent (a shell of the session agent, agent.py,
or of EXEC_SCRIPT) holds and the call does not inherit. The parent sends it to the host between
markers only it knows the nonce of. A call that never gets to hand it back (it replaced its shell
with `exec`, removed the trap, closed the parent) leaves the session as it was: the same in every
sandbox that runs it.

The host keeps the session of each container in memory and in a file of its own
(`SessionStore`: every process of the service on this host serves the same rollouts), and in the
labels of each snapshot (SESSION_LABEL): a fork resumes the same session.
"""

from __future__ import annotations

import base64
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import docker

from ..base import SandboxError

SESSION_LABEL = "tvcache.session"  # on snapshot images: the session (base64) a fork resumes
CWD_VAR = "__TVC_CWD"
# One argument of execve is capped at 128 KiB by Linux.
MAX_COMMAND_BYTES = 128 * 1024 - 1
SESSION_CHUNK_BYTES = 64 * 1024  # the session is sent as arguments of at most this many bytes each
# A session larger than this is not kept: the call that left it leaves the session as it was.
MAX_SESSION_BYTES = 1 << 20

# Run once in a fresh sandbox: the first session from the image's environment and working
# directory, in the syntax of the shell the calls run under (bash where it exists: the busybox image
# only has ash); the shell's path on the first line.
_INIT_SCRIPT = f"""if __tvc_bash=$(command -v bash); then echo "$__tvc_bash"
exec "$__tvc_bash" -c 'unset OLDPWD; export {CWD_VAR}="$(pwd)"; export -p'; fi
echo; unset OLDPWD __tvc_bash; export {CWD_VAR}="$(pwd)"; export -p"""

# Run per call as `env -i SHELL -c CALL_SCRIPT SHELL COMMAND SESSION...` (the session in chunks),
# by the session agent (agent.py) or by EXEC_SCRIPT, each in a session of its own (setsid, or the
# exec's): a timeout kills that session from the host (procs.py).
CALL_SCRIPT = f"""__tvc_cmd=$1; shift; __tvc_s=
for __tvc_x do __tvc_s=$__tvc_s$__tvc_x; done
set --
eval "$__tvc_s"
__tvc_cwd=${{{CWD_VAR}-/}}; unset {CWD_VAR} __tvc_s __tvc_x
if [ "${{OLDPWD+set}}" ]; then __tvc_old=$OLDPWD; else unset __tvc_old; fi
cd "$__tvc_cwd" 2>/dev/null || cd /
if [ "${{__tvc_old+set}}" ]; then OLDPWD=$__tvc_old; else unset OLDPWD; fi
trap "__tvc_rc=\\$?; {{ if [ \\"\\$PWD\\" -ef . ]; then {CWD_VAR}=\\$PWD; else {CWD_VAR}=\\$(pwd); fi
export {CWD_VAR}; export -p; }} >/proc/$PPID/fd/7 2>/dev/null; exit \\$__tvc_rc" EXIT
eval "unset __tvc_cwd __tvc_cmd __tvc_old
$__tvc_cmd"
"""

# A call by an exec of its own, where no session agent takes it (agent.py): run as
# `SHELL -c EXEC_SCRIPT SHELL CALL_SCRIPT NONCE COMMAND SESSION...`. The call's output is the exec's;
# the session it hands back follows it on stdout between markers (`\\0TVC<nonce> s` ... `end`), and the
# exec's exit code is the call's. As in the agent (agent.py), the shell that waits for the call has
# its own output on /dev/null (ash reports a child killed by a signal: "Killed").
EXEC_SCRIPT = r"""__tvc_sh=$0 __tvc_call=$1 __tvc_n=$2 __tvc_c=$3; shift 3
exec 5>&1 6>&2 >/dev/null 2>&1
__tvc_s=$( { (exec env -i "$__tvc_sh" -c "$__tvc_call" "$__tvc_sh" "$__tvc_c" "$@" </dev/null >&5 2>&6 5>&- 6>&- 7>&-)
printf '%s%s' "$__tvc_n" "$?"; } 7>&1 )
__tvc_r=${__tvc_s##*"$__tvc_n"} __tvc_s=${__tvc_s%"$__tvc_n"*}
printf '\0TVC%s s\n%s\0TVC%s end\n' "$__tvc_n" "$__tvc_s" "$__tvc_n" >&5
exit "$__tvc_r"
"""


def session_chunks(session: bytes) -> list[bytes]:
    """The session as the call's arguments (each within Linux's limit on one argument), cut where
    no UTF-8 character is split."""
    chunks, start = [], 0
    while start < len(session):
        end = min(start + SESSION_CHUNK_BYTES, len(session))
        while end < len(session) and end > start + 1 and session[end] & 0xC0 == 0x80:
            end -= 1
        chunks.append(session[start:end])
        start = end
    return chunks or [b""]


def exec_argv(shell: str, nonce: str, command: str, session: bytes) -> list[str]:
    """A call by exec (EXEC_SCRIPT). Arguments are text for the engine's JSON: a session whose bytes
    are not UTF-8 cannot go that way (SandboxError: the call did not run)."""
    try:
        chunks = [chunk.decode("utf-8") for chunk in session_chunks(session)]
    except UnicodeDecodeError:
        raise SandboxError(
            "the shell session holds bytes that are not UTF-8, which a docker exec cannot carry"
        ) from None
    return [shell, "-c", EXEC_SCRIPT, shell, CALL_SCRIPT, nonce, command, *chunks]


def session_init(api: docker.APIClient, container_id: str) -> str:
    """Takes the first session of a fresh sandbox (kept in the SessionStore); returns the shell that
    calls will run under."""
    shell, session = initial_session(api, container_id)
    sessions().put(container_id, SessionRecord(session))
    return shell


def initial_session(api: docker.APIClient, container_id: str) -> tuple[str, bytes]:
    exec_id = api.exec_create(container_id, ["/bin/sh", "-c", _INIT_SCRIPT])["Id"]
    out, err = api.exec_start(exec_id, demux=True)
    out = out or b""
    if api.exec_inspect(exec_id)["ExitCode"] != 0 or len(out) > MAX_SESSION_BYTES:
        message = (out + (err or b"")).decode("utf-8", errors="replace")
        raise SandboxError(f"could not initialise the shell session: {message[-500:]}")
    first, _, session = out.partition(b"\n")
    return first.decode("utf-8", errors="replace").strip() or "/bin/sh", session


def shell_probe(api: docker.APIClient, container_id: str) -> str:
    """The shell calls run under in a sandbox whose image does not say (bash where it exists)."""
    exec_id = api.exec_create(container_id, ["/bin/sh", "-c", "command -v bash || true"])["Id"]
    return api.exec_start(exec_id).decode("utf-8", errors="replace").strip() or "/bin/sh"


def session_label(session: bytes) -> str:
    return base64.b64encode(session).decode("ascii")


def labelled_session(labels: Mapping[str, Any] | None) -> bytes | None:
    """The session a snapshot image carries (SESSION_LABEL); None where it carries none."""
    value = (labels or {}).get(SESSION_LABEL)
    if not value or len(value) > 2 * MAX_SESSION_BYTES:
        return None
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """What the host keeps of a container between calls: its session, and its state as the last
    observed call left it (overlay.LayerState's digest and newest time, and how many processes it
    kept running), so that whichever process runs the next call can tell whether anything changed
    since (a process writing files)."""

    session: bytes
    layer: bytes | None = None
    newest_ns: int = 0
    live: int = 0

    def encode(self) -> bytes:
        layer = self.layer.hex() if self.layer is not None else "-"
        return f"v1 {layer} {self.newest_ns} {self.live}\n".encode() + self.session

    @classmethod
    def decode(cls, data: bytes) -> SessionRecord | None:
        head, newline, session = data.partition(b"\n")
        fields = head.split()
        if not newline or len(fields) != 4 or fields[0] != b"v1":
            return None
        try:
            layer = None if fields[1] == b"-" else bytes.fromhex(fields[1].decode())
            return cls(session, layer, int(fields[2]), int(fields[3]))
        except ValueError:
            return None


class SessionStore:
    """The SessionRecord of each container of this host's service: one file per container in a
    folder only the service writes, so that every process of the service (the tool-server processes,
    the workers) resumes what another left. A file is replaced by a rename, whole; its (inode,
    mtime) tell a process whether another changed it since it read it."""

    def __init__(self, root: str):
        self.root = root
        self._made = False

    def _path(self, container_id: str) -> str:
        if not container_id.isalnum() or len(container_id) > 128:
            raise ValueError(f"not a container id: {container_id!r}")
        return os.path.join(self.root, container_id)

    def put(self, container_id: str, record: SessionRecord) -> tuple[int, int] | None:
        """Keeps the container's record; returns the file's stamp (None: not kept on disk)."""
        path = self._path(container_id)
        try:
            if not self._made:
                os.makedirs(self.root, mode=0o700, exist_ok=True)
                self._made = True
            fd, temporary = tempfile.mkstemp(dir=self.root, prefix=".new-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(record.encode())
                    st = os.fstat(f.fileno())
                os.replace(temporary, path)
            except BaseException:
                try:
                    os.unlink(temporary)
                except OSError:
                    pass
                raise
            return st.st_ino, st.st_mtime_ns
        except OSError:
            return None

    def stamp(self, container_id: str) -> tuple[int, int] | None:
        try:
            st = os.stat(self._path(container_id))
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns

    def get(self, container_id: str) -> tuple[SessionRecord, tuple[int, int]] | None:
        try:
            with open(self._path(container_id), "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read(MAX_SESSION_BYTES + 256)
        except OSError:
            return None
        record = SessionRecord.decode(data) if len(data) <= MAX_SESSION_BYTES + 200 else None
        return (record, (st.st_ino, st.st_mtime_ns)) if record is not None else None

    def drop(self, container_id: str) -> None:
        try:
            os.unlink(self._path(container_id))
        except (OSError, ValueError):
            pass


_store: SessionStore | None = None


def sessions() -> SessionStore:
    """This host's SessionStore: TVCACHE_DOCKER_SESSION_DIR, else a folder of the system's
    temporary one per user (the service's processes share it)."""
    global _store
    if _store is None:
        root = os.environ.get("TVCACHE_DOCKER_SESSION_DIR") or os.path.join(
            tempfile.gettempdir(), f"tvcache-sessions-{os.getuid()}"
        )
        _store = SessionStore(root)
    return _store
