"""A docker call's processes as the host sees them, so that a timed-out call is killed from the host.

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
    children: dict[int, list[int]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p.pid)
    stack = list(members)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in members:
                members.add(child)
                stack.append(child)
    return sorted(members)


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
