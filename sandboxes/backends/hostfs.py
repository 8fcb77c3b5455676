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
from collections.abc import Iterator
from contextlib import contextmanager

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOATIME", 0)
_CHUNK = 1 << 20


class UnsafeEntry(OSError):
    """The entry is not what the host may read: a link, a FIFO, a device, or too large."""


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


def walk(root: str, *, max_entries: int) -> Iterator[tuple[str, os.stat_result]]:
    """(relative path, lstat) of every entry under `root`, parents before children, names sorted.
    Directories are entered through fds opened with O_NOFOLLOW, so a directory swapped for a link
    while the walk runs ends that branch instead of leading out of the tree."""
    count = 0
    stack: list[tuple[str, int]] = [("", os.open(root, _DIR_FLAGS))]
    try:
        while stack:
            relative, fd = stack.pop()
            try:
                names = sorted(os.listdir(fd))
                for name in names:
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    count += 1
                    if count > max_entries:
                        raise UnsafeEntry(f"more than {max_entries} entries")
                    path = f"{relative}/{name}" if relative else name
                    yield path, st
                    if stat.S_ISDIR(st.st_mode):
                        try:
                            stack.append((path, os.open(name, _DIR_FLAGS, dir_fd=fd)))
                        except (FileNotFoundError, NotADirectoryError, OSError):
                            continue
            finally:
                os.close(fd)
    finally:
        for _, fd in stack:
            os.close(fd)


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
