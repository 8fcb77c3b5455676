"""Whether a docker call changed its sandbox, read from the host's view of the container's layer.

An overlay2 container keeps everything it changed in its upper directory on the host: a new or
modified file is there (copied up), a deleted one leaves a whiteout there. Any change to a file
(content, mode, owner, links, xattrs) moves its ctime, which no program can set, so a listing of
the upper directory with (name, mode, owner, size, inode, mtime, ctime) taken after each call
changes exactly when the call changed the filesystem. The shell session's working directory and
exported variables live in files that every call rewrites; their contents are compared instead.
bind-mounted /etc/hosts, /etc/resolv.conf and /etc/hostname are listed too.

File times come from a coarse clock: two writes of the same file a clock tick apart or less can
carry the same time. `settle` makes a call start more than a tick after the newest time seen,
so the call's own writes always carry a later one.

An unchanged listing lets a call that the tool declares state-changing (`bash`) count as
read-only: later calls match regardless of it (DESIGN.md, stateful prefix matching). Where the
layer cannot be read (another storage driver, a remote engine, no permission) nothing is
observed and the declaration stands.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_CLOCK_REALTIME_COARSE = 5  # Linux's clock id


def _coarse_tick_ns() -> int:
    """How often the clock that stamps file times advances (one kernel tick); 10 ms (HZ=100, the
    longest) if it cannot be read."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        res = (ctypes.c_long * 2)()
        if libc.clock_getres(_CLOCK_REALTIME_COARSE, res) == 0 and 0 < res[1] <= 10_000_000 and res[0] == 0:
            return int(res[1])
    except (OSError, AttributeError, TypeError):
        pass
    return 10_000_000


_TICK_NS = _coarse_tick_ns()


@dataclass(frozen=True, slots=True)
class LayerState:
    digest: bytes
    newest_ns: int  # the newest ctime listed


class LayerTooLarge(Exception):
    """The layer holds more entries than a listing per call is worth."""


class LayerWatch:
    """Listing a layer costs about 10 us per entry here (0.3 ms for a small one, 14 ms at 2,000
    changed files, 210 ms at 20,000): past `max_entries` the sandbox is no longer observed."""

    def __init__(self, upper: str, merged: str, host_files: tuple[str, ...], session: tuple[str, tuple[str, ...]],
                 max_entries: int):
        self.upper, self.merged, self.host_files, self.max_entries = upper, merged, host_files, max_entries
        self.session_dir, self.session_files = session

    @classmethod
    def of(cls, container: Mapping[str, Any], *, session: tuple[str, tuple[str, ...]],
           max_entries: int) -> LayerWatch | None:
        """The watch for an inspected container, or None when its layer is out of reach.
        `session`: the folder of the shell session's state (relative to the container's root),
        left out of the listing, and its files that are compared by content."""
        driver = container.get("GraphDriver") or {}
        data = driver.get("Data") or {}
        upper, merged = data.get("UpperDir"), data.get("MergedDir")
        if driver.get("Name") != "overlay2" or not upper or not merged:
            return None
        if not (os.access(upper, os.R_OK | os.X_OK) and os.access(os.path.join(merged, session[0]), os.R_OK | os.X_OK)):
            return None
        host_files = tuple(p for p in (container.get(k) for k in ("HostsPath", "ResolvConfPath", "HostnamePath")) if p)
        return cls(upper, merged, host_files, session, max_entries)

    def state(self) -> LayerState:
        listing = hashlib.blake2b(digest_size=32)
        newest = listed = 0
        stack = [""]
        while stack:
            relative = stack.pop()
            with os.scandir(os.path.join(self.upper, relative)) as entries:
                found = sorted(entries, key=lambda entry: entry.name)
            for entry in found:
                path = f"{relative}/{entry.name}" if relative else entry.name
                if path == self.session_dir:
                    continue
                listed += 1
                if listed > self.max_entries:
                    raise LayerTooLarge(f"more than {self.max_entries} entries")
                st = entry.stat(follow_symlinks=False)
                newest = max(newest, st.st_ctime_ns)
                listing.update(_line(path, st))
                if entry.is_dir(follow_symlinks=False):
                    stack.append(path)
        for path in self.host_files:
            st = os.stat(path)
            newest = max(newest, st.st_ctime_ns)
            listing.update(_line(path, st))
        for name in self.session_files:
            with open(os.path.join(self.merged, self.session_dir, name), "rb") as f:
                listing.update(name.encode() + b"\0" + f.read() + b"\0")
        return LayerState(listing.digest(), newest)

    @staticmethod
    def settle(state: LayerState) -> None:
        """Wait until a write would carry a later file time than any in `state`."""
        wait_ns = state.newest_ns + _TICK_NS - time.time_ns()
        if wait_ns > 0:
            time.sleep(wait_ns / 1e9)


def _line(path: str, st: os.stat_result) -> bytes:
    return (f"{path}\0{st.st_mode}\0{st.st_uid}\0{st.st_gid}\0{st.st_size}\0{st.st_ino}\0{st.st_nlink}\0"
            f"{st.st_rdev}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n").encode("utf-8", "surrogateescape")
