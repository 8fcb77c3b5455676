"""Whether a docker call changed its sandbox, read from the host's view of the container's layer.

An overlay2 container keeps everything it changed in its upper directory on the host: a new or
modified file is there (copied up), a deleted one leaves a whiteout there. Any change to a file
(content, mode, owner, links, xattrs) moves its ctime, which no program can set, so a listing of
the upper directory with (name, mode, owner, size, inode, mtime, ctime) taken after each call
changes exactly when the call changed the filesystem. bind-mounted /etc/hosts, /etc/resolv.conf
and /etc/hostname are listed too. What the caller adds to a listing (`state(extra)`: the shell
session, which the host keeps out of the sandbox, and the processes the sandbox keeps running) is
compared with it.

File times come from a coarse clock: two writes of the same file a clock tick apart or less can
carry the same time. `settle` makes a call start more than a tick after the newest time seen,
so the call's own writes always carry a later one.

An unchanged listing lets a call that the tool declares state-changing (`bash`) count as
read-only: later calls match regardless of it (docs/design/index.md). Where the
layer cannot be read (another storage driver, a remote engine, no permission) nothing is
observed and the declaration stands.

Every read of the layer and of the container's files goes through hostfs: the host never follows
the sandbox's links, never opens its FIFOs or devices and never reads past a cap.

Two more things live here, both about exactness across snapshots:
- `docker commit` stores file times truncated to whole seconds (moby's tar headers), so a fork
  of a build tree sees a source edited 0.3 s after its object as exactly as old as it, and `make`
  says "up to date" where the original sandbox rebuilds. `restore_file_times` writes the exact
  times from the container's upper directory into the committed layer, once per snapshot.
- `fingerprint`: what a call left behind (paths, types, modes, owners, sizes, content
  digests, link targets, the order of file times, and what the caller adds: the shell session and
  the live processes), comparable across sandboxes, so a fork or a replay can be checked against
  the state its node recorded.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import hostfs

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


TICK_NS = _coarse_tick_ns()


# The engine's own entry in a container's layer (`--init`), made when the container starts: its
# time is the container's, not a call's, so a replay's order of times leaves it out.
ENGINE_PATHS = frozenset({"sbin/docker-init", "usr/sbin/docker-init"})  # /sbin may be a link to /usr/sbin


@dataclass(frozen=True, slots=True)
class LayerState:
    digest: bytes
    newest_ns: int  # the newest ctime listed


class LayerTooLarge(Exception):
    """The layer holds more entries than a listing per call is worth."""


class LayerWatch:
    """Listing a layer costs about 10 us per entry here (0.3 ms for a small one, 14 ms at 2,000
    changed files, 210 ms at 20,000): past `max_entries` the sandbox is no longer observed."""

    def __init__(
        self, upper: str, merged: str, host_files: tuple[str, ...], max_entries: int, lowers: tuple[str, ...] = ()
    ):
        self.upper, self.merged, self.host_files, self.max_entries = upper, merged, host_files, max_entries
        self.lowers = lowers  # the layers under the upper one, top first (the init layer left out)

    @classmethod
    def of(cls, container: Mapping[str, Any], *, max_entries: int) -> LayerWatch | None:
        """The watch for an inspected container, or None when its layer is out of reach."""
        driver = container.get("GraphDriver") or {}
        data = driver.get("Data") or {}
        upper, merged = data.get("UpperDir"), data.get("MergedDir")
        if driver.get("Name") != "overlay2" or not upper or not merged:
            return None
        if not (os.access(upper, os.R_OK | os.X_OK) and os.access(merged, os.R_OK | os.X_OK)):
            return None
        lowers = tuple(d for d in (data.get("LowerDir") or "").split(":") if d and not d.endswith("-init/diff"))
        host_files = tuple(p for p in (container.get(k) for k in ("HostsPath", "ResolvConfPath", "HostnamePath")) if p)
        return cls(upper, merged, host_files, max_entries, lowers)

    def state(self, extra: bytes = b"") -> LayerState:
        """The listing's digest, with `extra` (what the caller keeps of the state beyond the files)."""
        listing = hashlib.blake2b(digest_size=32)
        newest = 0
        if not os.path.isdir(self.merged):  # the engine's own folder: the container stopped (unmounted)
            raise FileNotFoundError(f"the container's root is not mounted: {self.merged}")
        try:
            for path, st in hostfs.walk(self.upper, max_entries=self.max_entries):
                newest = max(newest, st.st_ctime_ns)
                listing.update(_line(path, st))
        except hostfs.UnsafeEntry as exc:
            raise LayerTooLarge(str(exc)) from None
        for path in self.host_files:  # the engine's own files (bind-mounted into the container)
            st = os.stat(path, follow_symlinks=False)
            newest = max(newest, st.st_ctime_ns)
            listing.update(_line(path, st))
        listing.update(hashlib.sha256(extra).digest())
        return LayerState(listing.digest(), newest)

    @staticmethod
    def settle(state: LayerState) -> None:
        """Wait until a write would carry a later file time than any in `state`."""
        settle_after(state.newest_ns)

    def fingerprint(
        self,
        base_layers: frozenset[str],
        *,
        max_bytes: int,
        changed_since_ns: int | None = None,
        max_changed: tuple[int, int] | None = None,
        session: bytes = b"",
        processes: tuple[bytes, ...] = (),
    ) -> hostfs.StateDigest:
        """The StateFingerprint of the sandbox: every path that a layer above the base image holds
        (its snapshots' layers and its own), read in the merged view, with the shell session and the
        live processes (their lines) the caller keeps; with `changed_since_ns`, also the times of the
        entries changed since (a call's start: StateDigest.times)."""
        if not os.path.isdir(self.merged):
            raise FileNotFoundError(f"the container's root is not mounted: {self.merged}")
        paths: set[str] = set()
        for layer in self.lowers:
            if layer not in base_layers:
                paths |= _layer_paths(layer, self.max_entries)
        paths |= _listed_paths(self.upper, self.max_entries)
        fingerprint = hostfs.StateFingerprint(
            max_bytes=max_bytes, changed_since_ns=changed_since_ns, max_changed=max_changed, unordered=ENGINE_PATHS
        )
        fingerprint.add_tree(self.merged, paths)
        fingerprint.add_session("session", session)
        fingerprint.add_processes(processes)
        return fingerprint.digests()

    def set_file_times(self, times: Mapping[str, int]) -> int:
        """Give the listed entries (regular files, folders, links) the modification times a live
        call left them (StateDigest.times), in the merged view, without following the sandbox's
        links; an entry that is not there is skipped. Returns how many were set."""
        done = 0
        for kept, mtime_ns in times.items():
            parent, _, name = hostfs.time_path(kept).rpartition("/")
            if name in ("", ".", ".."):  # never a listed name: nothing outside the sandbox's own entries
                continue
            try:
                with hostfs.open_dir(self.merged, parent) as fd:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode):
                        os.utime(name, ns=(st.st_atime_ns, int(mtime_ns)), dir_fd=fd, follow_symlinks=False)
                        done += 1
            except (FileNotFoundError, NotADirectoryError, hostfs.UnsafeEntry):
                continue
            except OSError as exc:
                if exc.errno != 40:  # ELOOP: a link where a folder was
                    raise
        return done


def settle_after(newest_ns: int) -> None:
    """Sleep until the file-time clock has moved a tick past `newest_ns`, so that the next write
    carries a later time than any before it, as it would have in a live rollout."""
    wait_ns = newest_ns + TICK_NS - time.time_ns()
    if wait_ns > 0:
        time.sleep(wait_ns / 1e9)


# Paths of committed layers, which never change: listed once per process.
_LAYER_PATHS: dict[str, frozenset[str]] = {}


def _layer_paths(layer: str, max_entries: int) -> frozenset[str]:
    found = _LAYER_PATHS.get(layer)
    if found is None:
        found = _LAYER_PATHS[layer] = frozenset(_listed_paths(layer, max_entries))
        if len(_LAYER_PATHS) > 4096:
            _LAYER_PATHS.clear()
    return found


def _listed_paths(layer: str, max_entries: int) -> set[str]:
    try:
        return {path for path, _ in hostfs.walk(layer, max_entries=max_entries)}
    except hostfs.UnsafeEntry as exc:
        raise LayerTooLarge(str(exc)) from None


def restore_file_times(source: str, target: str, *, max_entries: int) -> int:
    """Give the entries of committed layer `target` the exact times their originals carry in the
    container's upper directory `source` (the commit kept whole seconds). Only where the target
    still holds the same entry as committed (same type and size, time equal to the source's
    truncated to the second); returns how many entries were restored."""
    restored = 0
    for path, st in hostfs.walk(source, max_entries=max_entries):
        if st.st_mtime_ns % 1_000_000_000 == 0 or not (
            stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)
        ):
            continue
        parent, _, name = path.rpartition("/")
        try:
            with hostfs.open_dir(target, parent) as fd:
                committed = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if (
                    stat.S_IFMT(committed.st_mode) != stat.S_IFMT(st.st_mode)
                    or committed.st_mtime_ns != st.st_mtime_ns // 1_000_000_000 * 1_000_000_000
                    or (stat.S_ISREG(st.st_mode) and committed.st_size != st.st_size)
                ):
                    continue
                os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=fd, follow_symlinks=False)
                restored += 1
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            if exc.errno != 40:
                raise
    return restored


def _line(path: str, st: os.stat_result) -> bytes:
    return (
        f"{path}\0{st.st_mode}\0{st.st_uid}\0{st.st_gid}\0{st.st_size}\0{st.st_ino}\0{st.st_nlink}\0"
        f"{st.st_rdev}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n"
    ).encode("utf-8", "surrogateescape")
