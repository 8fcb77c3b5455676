"""Reading a sandbox's files from the host without trusting them.

Everything under a container's layer or a folder sandbox was written by untrusted code, as root
on the host's side. The host therefore never follows a link in it, never opens anything but a
regular file, never blocks on an open (a FIFO), and never reads more than a cap: every path is
walked one component at a time from a directory fd with O_NOFOLLOW, files are opened
O_NONBLOCK and checked with fstat before a byte is read.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOATIME", 0)
_CHUNK = 1 << 20


class UnsafeEntry(OSError):
    """The entry is not what the host may read: a link, a FIFO, a device, or too large."""


def time_path(kept: str) -> str:
    """A path of StateDigest.times as the file system names it."""
    return os.fsdecode(kept.encode("latin-1"))


@contextmanager
def open_dir(root: str, relative: str = "") -> Iterator[int]:
    """A directory fd for `root`/`relative`, walked component by component without following links.
    `root` itself is the host's own path (trusted); `relative` is the sandbox's."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in _parts(relative):
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def read_regular(dir_fd: int, name: str, *, max_bytes: int) -> bytes:
    """The content of regular file `name` in `dir_fd`, at most `max_bytes` (UnsafeEntry beyond)."""
    fd = _open_regular(dir_fd, name)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise UnsafeEntry(f"{name}: {size} bytes, more than {max_bytes}")
        data = os.read(fd, max_bytes + 1)
        if len(data) > max_bytes:
            raise UnsafeEntry(f"{name}: more than {max_bytes} bytes")
        return data
    finally:
        os.close(fd)


def read_file(root: str, relative: str, *, max_bytes: int) -> bytes:
    parent, _, name = relative.rpartition("/")
    with open_dir(root, parent) as fd:
        return read_regular(fd, name, max_bytes=max_bytes)


def digest_regular(dir_fd: int, name: str, *, max_bytes: int) -> str:
    """sha256 of regular file `name`, read in chunks, at most `max_bytes`."""
    fd = _open_regular(dir_fd, name)
    try:
        digest, read = hashlib.sha256(), 0
        while chunk := os.read(fd, _CHUNK):
            read += len(chunk)
            if read > max_bytes:
                raise UnsafeEntry(f"{name}: more than {max_bytes} bytes")
            digest.update(chunk)
        return digest.hexdigest()
    finally:
        os.close(fd)


class TooDeep(UnsafeEntry):
    """Folders nested deeper than the walk goes (one descriptor per level)."""


def walk(
    root: str, *, max_entries: int | None = None, max_depth: int = 128, too_deep: Callable[[str], None] | None = None
) -> Iterator[tuple[str, os.stat_result]]:
    """(relative path, lstat) of every entry under `root`, depth first, parents before children,
    names sorted. Folders are entered through descriptors opened with O_NOFOLLOW relative to
    their parent's (one open per level), so a folder swapped for a link while the walk runs ends
    that branch instead of leading out of the tree. Past `max_entries` entries, or `max_depth`
    levels, raises UnsafeEntry (TooDeep), unless `too_deep` is given: it is called with the path of
    each folder left out for its depth."""
    count = 0
    stack: list[tuple[str, int, Iterator[str]]] = []

    def enter(relative: str, fd: int) -> None:
        try:
            names = iter(sorted(os.listdir(fd)))
        except FileNotFoundError:  # removed while the walk ran
            os.close(fd)
            return
        except BaseException:
            os.close(fd)
            raise
        stack.append((relative, fd, names))

    enter("", os.open(root, _DIR_FLAGS))
    try:
        while stack:
            relative, fd, names = stack[-1]
            name = next(names, None)
            if name is None:
                os.close(fd)
                stack.pop()
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            count += 1
            if max_entries is not None and count > max_entries:
                raise UnsafeEntry(f"more than {max_entries} entries")
            path = f"{relative}/{name}" if relative else name
            yield path, st
            if not stat.S_ISDIR(st.st_mode):
                continue
            if len(stack) >= max_depth:
                if too_deep is None:
                    raise TooDeep(f"folders nested deeper than {max_depth}")
                too_deep(path)
                continue
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:  # gone, or swapped for something else since it was listed
                continue
            enter(path, child)
    finally:
        for _, fd, _ in stack:
            os.close(fd)


@dataclass(frozen=True, slots=True)
class StateDigest:
    """`full`: everything, contents and the order of file times included, for a fork: a copy
    must be exact (and keeps exact times, overlay.restore_file_times). `shape`: paths, types,
    modes, owners, sizes, link targets and the shell session, for a replay. A replay runs at
    another time and another pace: contents that embed the time (bytecode caches, archives,
    logs) differ, and so does which writes of one call share a clock tick (a loop of 25 `git
    commit`s), exactly as they would between two live rollouts. Replayed calls run a clock tick
    apart, so the order of times between calls is the live one (the `make` case); within a call
    it is as (non)deterministic as the call itself, which the determinism audit samples."""

    full: str
    shape: str
    # `shape` and the ranks of the modification times: what a replay that wrote back every
    # replayed call's live times (`times`) must match; contents that embed the time of a write
    # inside a call (an archive, the git index) differ between any two runs, so they are left out.
    order: str = ""
    # The modification times (ns) of the entries the last call changed, by path: what a replay
    # of that call writes back after it runs (overlay.set_file_times), so that the replayed
    # state carries the times the live one did. None when not asked for or not kept (more than
    # `max_changed`'s entries or path bytes, a name that is not UTF-8).
    times: Mapping[str, int] | None = field(default=None, compare=False)
    # How many processes the sandbox keeps running (its own: not the service's), part of all three
    # digests. A filesystem snapshot never stands in for a state that has some (docs/design/state.md).
    processes: int = 0
    # False when the state kept changing after the call that left it (a process the call started
    # writes files): it depends on timing, and no other sandbox can be checked against it.
    settled: bool = field(default=True, compare=False)


class StateFingerprint:
    """Digests of a sandbox's state (StateDigest) that two sandboxes reach alike only in the
    same state. Lines of (path, type, mode, owner, size, link target), sorted by path; the full
    digest adds content digests and ranks of the regular files' and links' modification times
    (equal times share a rank), so a fork whose times kept their order matches, and one where a
    source became as old as its object does not."""

    def __init__(
        self,
        *,
        max_bytes: int,
        times: bool = True,
        changed_since_ns: int | None = None,
        max_changed: tuple[int, int] | None = None,
        unordered: frozenset[str] = frozenset(),
    ):
        self.max_bytes, self.times, self.changed_since_ns = max_bytes, times, changed_since_ns
        # (entries, path bytes): the most of the changed entries' times kept (None: no cap). A call
        # that wrote more, an install, keeps none: replays restore times only up to such a call.
        self.max_changed = max_changed
        self.unordered = unordered  # paths whose time `order` leaves out: the engine's, set at start
        self._entries: list[tuple[str, str, str, int]] = []  # (path, line, content digest, mtime or -1)
        self._changed: dict[str, int] = {}  # mtimes of the entries changed since `changed_since_ns` (ctime)
        self._session: list[bytes] = []
        self._processes: list[bytes] = []
        self._read = 0

    def add_tree(self, root: str, paths: set[str]) -> None:
        by_parent: dict[str, list[str]] = {}
        for path in paths:
            parent, _, name = path.rpartition("/")
            by_parent.setdefault(parent, []).append(name)
        for parent in sorted(by_parent):
            try:
                with open_dir(root, parent) as fd:
                    for name in sorted(by_parent[parent]):
                        self._add(fd, f"{parent}/{name}" if parent else name, name)
            except (FileNotFoundError, NotADirectoryError):
                continue  # the folder is gone (a whiteout above it): its paths are absent
            except OSError as exc:
                if exc.errno != 40:  # ELOOP: a link replaced the folder; nothing under it is listed
                    raise

    def add_session(self, name: str, content: bytes) -> None:
        self._session.append(name.encode() + b"\0" + hashlib.sha256(content).digest())

    def add_processes(self, lines: tuple[bytes, ...] | list[bytes]) -> None:
        """The live processes, each as the line it is compared by (procs.LiveProcess.line): as a
        multiset (sorted), since the order they started in is not compared."""
        self._processes.extend(lines)

    def digests(self) -> StateDigest:
        times = sorted({mtime for _, _, _, mtime in self._entries if mtime >= 0})
        rank = {mtime: index for index, mtime in enumerate(times)}
        # ranks by nanosecond and by whole second: tools read either (make; a .pyc, `test -nt`, tar)
        timed = {mtime for path, _, _, mtime in self._entries if mtime >= 0 and path not in self.unordered}
        ordered = {mtime: index for index, mtime in enumerate(sorted(timed))}
        seconds = {second: index for index, second in enumerate(sorted({mtime // 1_000_000_000 for mtime in timed}))}
        full, shape, order = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
        for path, line, content, mtime in sorted(self._entries):
            encoded = line.encode("utf-8", "surrogateescape")
            full.update(encoded + f"\0{content}\0{rank.get(mtime, -1)}\n".encode())
            shape.update(encoded + b"\n")
            known = mtime >= 0 and path not in self.unordered
            ranks = f"{ordered[mtime]}\0{seconds[mtime // 1_000_000_000]}" if known else "-1"
            order.update(encoded + f"\0{ranks}\n".encode())
        for session in self._session:
            full.update(session)
            shape.update(session)
            order.update(session)
        if self._processes:  # a state without any digests as it did before processes were observed
            listed = b"processes\0" + b"\n".join(sorted(self._processes))
            for digest in (full, shape, order):
                digest.update(hashlib.sha256(listed).digest())
        return StateDigest(
            full=full.hexdigest(),
            shape=shape.hexdigest(),
            order=order.hexdigest(),
            times=self._kept_times(),
            processes=len(self._processes),
        )

    def _kept_times(self) -> dict[str, int] | None:
        """The changed entries' times by path, each path's bytes as Latin-1 text (any name, also one
        that is not UTF-8, is JSON text so: `time_path` reads it back)."""
        max_entries, max_path_bytes = self.max_changed or (len(self._changed), None)
        if self.changed_since_ns is None or len(self._changed) > max_entries:
            return None
        kept = {os.fsencode(path).decode("latin-1"): mtime for path, mtime in self._changed.items()}
        return kept if max_path_bytes is None or sum(map(len, kept)) <= max_path_bytes else None

    def _add(self, fd: int, path: str, name: str) -> None:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return  # deleted (a whiteout in a layer above): absent paths are not listed
        kind = stat.S_IFMT(st.st_mode)
        detail, content, mtime = "", "", -1
        if stat.S_ISREG(st.st_mode):
            self._read += st.st_size
            if self._read > self.max_bytes:
                raise UnsafeEntry(f"more than {self.max_bytes} bytes to fingerprint")
            content, mtime = _cached_digest(fd, name, st, self.max_bytes), st.st_mtime_ns if self.times else -1
        elif stat.S_ISLNK(st.st_mode):
            detail, mtime = os.readlink(name, dir_fd=fd), st.st_mtime_ns if self.times else -1
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            detail = str(st.st_rdev)
        if (
            self.changed_since_ns is not None
            and st.st_ctime_ns >= self.changed_since_ns
            and (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode))
        ):
            self._changed[path] = st.st_mtime_ns
        size = st.st_size if not stat.S_ISDIR(st.st_mode) else 0
        line = f"{path}\0{kind}\0{stat.S_IMODE(st.st_mode)}\0{st.st_uid}\0{st.st_gid}\0{size}\0{detail}"
        self._entries.append((path, line, content, mtime))


# Content digests by (device, inode, size, mtime, ctime): a file's ctime moves with every change
# and no program can set it, so an unchanged key is an unchanged file.
_DIGESTS: dict[tuple[int, int, int, int, int], str] = {}
_DIGESTS_MAX = 200_000


def _cached_digest(fd: int, name: str, st: os.stat_result, max_bytes: int) -> str:
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    found = _DIGESTS.get(key)
    if found is None:
        found = digest_regular(fd, name, max_bytes=max_bytes)
        if len(_DIGESTS) >= _DIGESTS_MAX:
            _DIGESTS.clear()
        _DIGESTS[key] = found
    return found


def _open_regular(dir_fd: int, name: str) -> int:
    if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
        raise UnsafeEntry(f"{name}: not a regular file")  # never open a device or a FIFO at all
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (getattr(os, "ELOOP", 40), getattr(os, "ENXIO", 6)):
            raise UnsafeEntry(f"{name}: not a regular file") from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeEntry(f"{name}: not a regular file")
    return fd


def _parts(relative: str) -> list[str]:
    parts = [part for part in relative.split("/") if part and part != "."]
    if ".." in parts:
        raise UnsafeEntry(f"{relative!r} leaves its root")
    return parts
