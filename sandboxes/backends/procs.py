"""A docker sandbox's processes as the host sees them: a timed-out call's, killed from the host, and
those the sandbox keeps running between calls, observed as part of its state (`live_processes`,
below; docs/design/state.md).

Nothing inside the sandbox decides what is killed: not a pid file it could overwrite, not a shell it
could replace. The engine names the call's first process by its host pid (exec inspect), or, for
a call of a session agent (docker/agent.py), the engine names the agent and the call is the
session below it (`sessions_below`). The call's session, its process group and its descendants
are frozen (SIGSTOP, so none forks meanwhile) until no new one appears, then killed. Each process is signalled through a pidfd, after checking that
it sits in the container's cgroup, so a pid reused by a process outside the container is never hit.
A process that left the call's session and tree on purpose (a daemon the agent detached) outlives
the call, as it would outlive a terminal that closed.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import signal
from dataclasses import dataclass

_FREEZE_ROUNDS = 20


@dataclass(frozen=True, slots=True)
class _Proc:
    pid: int
    ppid: int
    pgid: int
    sid: int


def host_sees(container_id: str, init_pid: int) -> bool:
    """Whether this process sees the container's processes under the engine's pids (same host, same
    pid namespace): its init must be there, in the container's cgroup."""
    return init_pid > 0 and _in_container(init_pid, container_id)


def kill_call_tree(pid: int, container_id: str) -> int:
    """SIGKILL `pid` (a host pid), its session and process group, and their descendants, all in the
    container. Returns how many processes were signalled (0: the call had already ended)."""
    frozen: dict[int, int] = {}  # pid -> pidfd, each verified in the container
    try:
        for _ in range(_FREEZE_ROUNDS):
            new = [p for p in _call_tree(pid, set(frozen)) if p not in frozen]
            if not new:
                break
            for member in new:
                fd = _pidfd_in_container(member, container_id)
                if fd is not None:
                    frozen[member] = fd
                    _signal(fd, signal.SIGSTOP)
        for fd in frozen.values():
            _signal(fd, signal.SIGKILL)
    finally:
        for fd in frozen.values():
            os.close(fd)
    return len(frozen)


def sessions_below(pid: int, container_id: str) -> list[int]:
    """Host pids of the topmost session leaders among `pid`'s descendants in the container: the
    calls a session agent started, each in a session of its own."""
    procs = _processes()
    by_pid = {p.pid: p for p in procs}
    own = by_pid.get(pid)
    if own is None:
        return []
    children: dict[int, list[int]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p.pid)
    found, stack = [], list(children.get(pid, ()))
    while stack:
        member = by_pid[stack.pop()]
        if member.sid == member.pid and member.sid != own.sid:
            found.append(member.pid)
        else:
            stack.extend(children.get(member.pid, ()))
    return [p for p in found if _in_container(p, container_id)]


def _call_tree(pid: int, known: set[int]) -> list[int]:
    """Pids of the call's session and group, and of their descendants (and of those already found)."""
    procs = _processes()
    members = {p.pid for p in procs if p.pid == pid or p.sid == pid or p.pgid == pid} | (known & {p.pid for p in procs})
    return sorted(with_descendants(members, procs))


def with_descendants(members: set[int], procs) -> set[int]:
    """`members` and every descendant of theirs among `procs` (anything with `pid` and `ppid`)."""
    children: dict[int, list[int]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p.pid)
    found, stack = set(members), list(members)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _processes() -> list[_Proc]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        # pid (comm) state ppid pgrp session ...: comm may hold spaces and parentheses.
        fields = stat[stat.rindex(b")") + 2 :].split()
        found.append(_Proc(int(name), int(fields[1]), int(fields[2]), int(fields[3])))
    return found


def _pidfd_in_container(pid: int, container_id: str) -> int | None:
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # exited meanwhile
        return None
    # Checked after the pidfd pins the process: if the pid was reused before, this sees the new one.
    if _in_container(pid, container_id):
        return fd
    os.close(fd)
    return None


def _in_container(pid: int, container_id: str) -> bool:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            cgroups = f.read()
    except OSError:
        return False
    # cgroupfs: .../docker/<id>; systemd: .../docker-<id>.scope (v1 and v2 alike).
    return any(container_id in line.rsplit(":", 1)[-1] for line in cgroups.splitlines())


def _signal(pidfd: int, signum: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, signum)
    except ProcessLookupError:
        pass


# --- the processes a sandbox keeps running (docs/design/state.md) ----------------------------------
#
# What later calls can observe of a process an earlier call left running: what it runs (argv), where
# (its working directory), as whom (effective uid and gid) and the sockets it listens on. Compared
# are the processes docker's init adopted: whatever a call left running once its shell exited (a
# background job, a daemon, a server), each with the listening sockets of its whole tree. Their own
# children are not compared one by one: a loop's `sleep` comes and goes, a server's workers start
# and end as it pleases; what a later call can reach of them is their parent's sockets. Pids, start
# times and the order of starts are not compared: they depend on how many processes every earlier
# call forked (the session agent's relays, a replay's own calls) and, for a server's workers, on
# which one the scheduler ran first.
#
# Everything is read from the host's /proc, through a descriptor of each process's folder, so a
# pid reused meanwhile is never read as the sandbox's: the process is checked to sit in the
# container's cgroup through that same descriptor. Nothing the sandbox wrote is followed: the
# working directory is the text of a magic link (readlinkat, never opened), argv is data (capped),
# and every file read is the kernel's, opened O_NONBLOCK. What is the service's own is told by the
# kernel, not by names: docker's init (the container's first process), the keep-alive that init
# started first, and every process the engine started from outside the container (a `docker exec`:
# the session agents, an exec'd call) with its descendants. A call's processes are none of those:
# once its shell exits they are adopted by init.

_MAX_ARGV_BYTES = 256 << 10
_MAX_FDS = 4096  # a process's descriptors looked at for the sockets it listens on
_TCP_LISTEN, _UDP_BOUND = "0A", "07"
_UNIX_LISTENING = 0x10000  # __SO_ACCEPTCON
_PROC_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_PROC_FILE_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
_cgroup_files: dict[str, str] = {}  # container id -> its cgroup.procs on this host


@dataclass(frozen=True, slots=True)
class LiveProcess:
    """A process of the sandbox's own, as later calls can observe it (the module's notes above)."""

    argv: bytes  # NUL-terminated words, as /proc/<pid>/cmdline holds them
    cwd: bytes  # as the sandbox names it; b"" where unknown
    uid: int
    gid: int
    listening: tuple[str, ...] = ()  # its tree's: "tcp 0.0.0.0:8089", "tcp6 [::]:8080", "unix /run/x.sock"
    start: int = 0  # clock ticks since boot: orders a listing, never compared
    runnable: bool = False  # a process of its tree was running or waiting for a CPU: never compared

    def line(self) -> bytes:
        """What a fingerprint compares of the process."""
        return b"\0".join(
            (
                hashlib.sha256(self.argv).hexdigest().encode(),
                self.cwd,
                str(self.uid).encode(),
                str(self.gid).encode(),
                " ".join(self.listening).encode(),
            )
        )


def live_processes(container_id: str, init_pid: int, keepalive: tuple[str, ...]) -> tuple[LiveProcess, ...] | None:
    """The processes the sandbox keeps running apart from the service's own, those init adopted, in
    start order; None when they cannot be read from this host (another host's engine, no /proc
    access)."""
    pids = _container_pids(container_id, init_pid)
    if pids is None:
        return None
    fds: dict[int, int] = {}
    try:
        for pid in pids:
            try:
                fd = os.open(f"/proc/{pid}", _PROC_DIR_FLAGS)
            except OSError:  # exited meanwhile
                continue
            fds[pid] = fd
        stats = {pid: stat for pid, fd in fds.items() if (stat := _stat(fd)) is not None}
        found = [
            pid
            for pid in _theirs(stats, init_pid, keepalive, lambda pid: _argv(fds[pid]))
            if _in_container_fd(fds[pid], container_id)
        ]  # else the pid is another process's now
        if not found:
            return ()
        inodes = {pid: _socket_inodes(fds[pid]) for pid in found}
        listening = _listening_sockets(container_id, fds.get(init_pid), set().union(*inodes.values()))
        processes = []
        for root, tree in _trees(stats, init_pid, found).items():
            uid, gid = _ids(fds[root])
            sockets = tuple(sorted({listening[inode] for pid in tree for inode in inodes[pid] if inode in listening}))
            processes.append(
                LiveProcess(_argv(fds[root]), _cwd(fds[root]), uid, gid, sockets, stats[root][2], _busy(stats, tree))
            )
        return tuple(sorted(processes, key=lambda p: (p.start, p.line())))
    finally:
        for fd in fds.values():
            os.close(fd)


def engine_processes(top: dict, init_pid: int, keepalive: tuple[str, ...]) -> tuple[LiveProcess, ...] | None:
    """The same as the engine lists them (`docker top`: its runtime's own process table, for a sandbox
    whose processes the host does not see): argv as text, no working directory nor sockets."""
    titles = top.get("Titles") or []
    try:
        at_pid, at_ppid = titles.index("PID"), titles.index("PPID")
        at_cmd = titles.index("CMD") if "CMD" in titles else titles.index("COMMAND")
    except ValueError:
        return None
    stats, argv = {}, {}
    for row in top.get("Processes") or []:
        try:
            pid, ppid = int(row[at_pid]), int(row[at_ppid])
        except (ValueError, IndexError):
            return None
        stats[pid] = ("S", ppid, pid)  # no start times: pids order them (one kernel, counting up)
        argv[pid] = " ".join(row[at_cmd:]).encode()
    if init_pid not in stats:  # the runtime numbers the sandbox's processes its own way: its init is the lowest
        init_pid = min((pid for pid, (_, ppid, _) in stats.items() if ppid not in stats), default=0)
    found = _theirs(stats, init_pid, keepalive, lambda pid: argv[pid].replace(b" ", b"\0"))
    return tuple(
        LiveProcess(argv[root].replace(b" ", b"\0"), b"", -1, -1, (), stats[root][2])
        for root in _trees(stats, init_pid, found)
    )


def _trees(stats: dict[int, tuple[str, int, int]], init_pid: int, found: list[int]) -> dict[int, list[int]]:
    """The processes among `found` that init adopted, in `found`'s order, each with its tree (itself
    and its descendants among `found`)."""
    theirs = set(found)
    trees: dict[int, list[int]] = {pid: [pid] for pid in found if stats[pid][1] == init_pid}
    for pid in found:
        top, seen = pid, 0
        while stats[top][1] in theirs and seen < len(found):
            top, seen = stats[top][1], seen + 1
        if top != pid and top in trees:
            trees[top].append(pid)
    return trees


def _busy(stats: dict[int, tuple[str, int, int]], tree: list[int]) -> bool:
    """Whether a process of `tree` is at work: running or runnable (R), or in an uninterruptible
    wait (D), as a loop that writes is, even one starved of CPU."""
    return any(stats[pid][0] in ("R", "D") for pid in tree)


def _theirs(stats: dict[int, tuple[str, int, int]], init_pid: int, keepalive: tuple[str, ...], argv) -> list[int]:
    """The sandbox's own live processes among `stats` (pid -> (state, ppid, start)), in start order:
    not init, not the keep-alive init started first, not an exec (its parent is outside the
    container) nor anything below one."""
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    ours = {init_pid}
    first = min(children.get(init_pid, ()), key=lambda pid: (stats[pid][2], pid), default=None)
    if first is not None and argv(first).rstrip(b"\0") == "\0".join(keepalive).encode():
        ours.add(first)
    stack = [pid for pid, (_, ppid, _) in stats.items() if pid != init_pid and ppid not in stats]
    while stack:
        pid = stack.pop()
        if pid not in ours:
            ours.add(pid)
            stack.extend(children.get(pid, ()))
    alive = [pid for pid, (state, _, _) in stats.items() if pid not in ours and state not in ("Z", "X")]
    return sorted(alive, key=lambda pid: (stats[pid][2], pid))


def _container_pids(container_id: str, init_pid: int) -> list[int] | None:
    """The pids in the container's cgroup (its pids controller's cgroup.procs, found once from its
    init's /proc/<pid>/cgroup); None when that is not in this host's reach."""
    path = _cgroup_files.get(container_id)
    if path is None:
        path = _cgroup_procs_file(init_pid, container_id)
        if path is None:
            return None
        if len(_cgroup_files) > 4096:
            _cgroup_files.clear()
        _cgroup_files[container_id] = path
    try:
        fd = os.open(path, _PROC_FILE_FLAGS)
        try:
            data = _read_all(fd, 1 << 20)
        finally:
            os.close(fd)
    except OSError:
        _cgroup_files.pop(container_id, None)
        return None
    pids = [int(line) for line in data.split() if line.isdigit()]
    return pids if init_pid in pids else None


def _cgroup_procs_file(init_pid: int, container_id: str) -> str | None:
    try:
        with open(f"/proc/{init_pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if container_id not in path:
            continue
        if "pids" in controllers.split(","):
            candidates.append(f"/sys/fs/cgroup/pids{path}/cgroup.procs")
        elif controllers == "":
            candidates += [f"/sys/fs/cgroup{path}/cgroup.procs", f"/sys/fs/cgroup/unified{path}/cgroup.procs"]
    return next((c for c in candidates if os.path.isfile(c)), None)


def _read_all(fd: int, cap: int) -> bytes:
    chunks, size = [], 0
    while size <= cap:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)[:cap]


def _read_at(dir_fd: int, name: str, cap: int = 65536) -> bytes:
    fd = os.open(name, _PROC_FILE_FLAGS, dir_fd=dir_fd)
    try:
        return _read_all(fd, cap)
    finally:
        os.close(fd)


def _stat(dir_fd: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time in ticks) of a /proc/<pid> folder."""
    try:
        stat = _read_at(dir_fd, "stat")
        fields = stat[stat.rindex(b")") + 2 :].split()
        return fields[0].decode(), int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _argv(dir_fd: int) -> bytes:
    try:
        return _read_at(dir_fd, "cmdline", _MAX_ARGV_BYTES)
    except OSError:
        return b""


def _cwd(dir_fd: int) -> bytes:
    try:
        return os.readlink("cwd", dir_fd=dir_fd).encode("utf-8", "surrogateescape")
    except OSError:
        return b""


def _ids(dir_fd: int) -> tuple[int, int]:
    try:
        status = _read_at(dir_fd, "status").decode("utf-8", "replace")
    except OSError:
        return -1, -1
    found = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid"):
            fields = value.split()
            found[key] = int(fields[1]) if len(fields) > 1 else -1  # effective
    return found.get("Uid", -1), found.get("Gid", -1)


def _in_container_fd(dir_fd: int, container_id: str) -> bool:
    try:
        cgroups = _read_at(dir_fd, "cgroup").decode("utf-8", "replace")
    except OSError:
        return False
    return any(container_id in line.rsplit(":", 1)[-1] for line in cgroups.splitlines())


# Listening sockets by inode, per container: a socket keeps its inode for its life, so one found
# listening is not looked for again. Reading the kernel's TCP tables walks every bucket of the
# host's connection hash (~5 ms here), so they are read only for sockets the cheaper UNIX and UDP
# tables do not explain.
_listeners_known: dict[str, dict[int, str]] = {}


def _listening_sockets(container_id: str, init_fd: int | None, inodes: set[int]) -> dict[int, str]:
    known = _listeners_known.setdefault(container_id, {})
    unknown = inodes - known.keys()
    if unknown and init_fd is not None:
        for tables in (("unix", "udp", "udp6"), ("tcp", "tcp6")):
            found = _listeners(init_fd, tables)
            known.update(found)
            unknown -= found.keys()
            if not unknown:
                break
        if len(_listeners_known) > 4096:
            _listeners_known.clear()
    return known


def _socket_inodes(dir_fd: int) -> set[int]:
    try:
        fd_dir = os.open("fd", _PROC_DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return set()
    try:
        found = set()
        for name in os.listdir(fd_dir)[:_MAX_FDS]:
            try:
                target = os.readlink(name, dir_fd=fd_dir)
            except OSError:
                continue
            if target.startswith("socket:[") and target.endswith("]") and target[8:-1].isdigit():
                found.add(int(target[8:-1]))
        return found
    finally:
        os.close(fd_dir)


def _listeners(init_fd: int, tables: tuple[str, ...]) -> dict[int, str]:
    """Listening sockets of the container's network namespace in `tables`, by inode: TCP in LISTEN,
    bound UDP, listening UNIX sockets."""
    found: dict[int, str] = {}
    try:
        net = os.open("net", _PROC_DIR_FLAGS | os.O_NOFOLLOW, dir_fd=init_fd)
    except OSError:
        return found
    try:
        for proto in tables:
            try:
                rows = _read_at(net, proto, 64 << 20).decode("utf-8", "surrogateescape").splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                if proto == "unix":
                    fields = row.split(None, 7)
                    if len(fields) >= 8 and int(fields[3], 16) & _UNIX_LISTENING:
                        found[int(fields[6])] = f"unix {fields[7]}"
                    continue
                fields = row.split()
                if len(fields) < 10 or fields[3] != (_TCP_LISTEN if proto.startswith("tcp") else _UDP_BOUND):
                    continue
                address, _, port = fields[1].partition(":")
                if int(port, 16):
                    found[int(fields[9])] = f"{proto} {_address(address)}:{int(port, 16)}"
    except ValueError:  # a table out of its format: none of its sockets is known
        return {}
    finally:
        os.close(net)
    return found


def _address(hexed: str) -> str:
    raw = bytes.fromhex(hexed)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    return f"[{ipaddress.IPv6Address(b''.join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))}]"


# Under a runtime with a kernel of its own (gVisor) the host sees none of the sandbox's processes
# (and `docker top` lists the host's): one exec lists them from the sandbox's own /proc. Its shell
# could be a tampered one that lies; what it could hide is only the sandbox's own state, whose
# snapshots under such a runtime keep processes anyway (docs/design/state.md). The same listing
# serves the fingerprint and the kill of a timed-out call (docker/checkpoint.py). Records end with
# a NUL: "pid ppid pgid sid start state" \1 cwd \1 argv (its words \1-separated).
INSIDE_SCAN = r"""for d in /proc/[0-9]*; do
p=${d#/proc/}
[ "$p" = "$$" ] && continue
IFS= read -r s 2>/dev/null <"$d/stat" || continue
s=${s##*) }; set -- $s
c=; cd -P "$d/cwd" 2>/dev/null && c=$PWD; cd /
printf '%s %s %s %s %s %s\1%s\1' "$p" "$2" "$3" "$4" "${20}" "$1" "$c"
while IFS= read -r -d '' w; do printf '%s\1' "$w"; done 2>/dev/null <"$d/cmdline"
printf '\0'
done
"""


@dataclass(frozen=True)
class InsideProcess:
    """A process as INSIDE_SCAN lists it from the sandbox's own /proc."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    start: int
    state: str
    cwd: bytes
    argv: bytes  # NUL-terminated words, as /proc/<pid>/cmdline holds them


def inside_listing(listing: bytes) -> tuple[list[InsideProcess], bool]:
    """INSIDE_SCAN's processes, and whether every record was whole (a process that exited mid-scan
    is simply absent; a record out of format is left out and makes it False)."""
    found, whole = [], True
    for record in listing.split(b"\0"):
        if not record:
            continue
        head, _, tail = record.partition(b"\1")
        cwd, _, argv = tail.partition(b"\1")
        fields = head.split()
        if len(fields) != 6 or not all(f.isdigit() for f in fields[:5]):
            whole = False
            continue
        pid, ppid, pgid, sid, start = map(int, fields[:5])
        state = fields[5].decode("ascii", "replace")
        found.append(InsideProcess(pid, ppid, pgid, sid, start, state, cwd, argv.replace(b"\1", b"\0")))
    return found, whole


def inside_processes(listing: bytes, keepalive: tuple[str, ...]) -> tuple[LiveProcess, ...] | None:
    """The sandbox's own live processes from INSIDE_SCAN's output (its init is pid 1; execs, the
    scan's own included, have no parent in the sandbox)."""
    listed, whole = inside_listing(listing)
    by_pid = {p.pid: p for p in listed}
    if not whole or 1 not in by_pid:
        return None
    stats = {p.pid: (p.state, p.ppid, p.start) for p in listed}
    found = _theirs(stats, 1, keepalive, lambda pid: by_pid[pid].argv)
    return tuple(
        LiveProcess(by_pid[root].argv, by_pid[root].cwd, -1, -1, (), by_pid[root].start, _busy(stats, tree))
        for root, tree in _trees(stats, 1, found).items()
    )
