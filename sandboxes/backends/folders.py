"""Labelled folders on local disk: how the directory and sqlite backends keep sandboxes and snapshots.

Each entry is root/<32 hex id>/ holding `meta.json` (labels, creation time) and the backend's
payload. Entries are built in a hidden staging folder and published by one rename, and removed
by renaming them away first, so a listing never shows a half-built or half-deleted entry.
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import hostfs
from .base import OWNER, OWNER_LABEL, DiskQuotaExceeded, OwnedResource, PathTooLong, labels_match

_ID = re.compile(r"[0-9a-f]{32}")
_META = "meta.json"


class FolderStore:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def create(self, labels: Mapping[str, str], build: Callable[[Path], None]) -> str:
        """Build a new entry with `build(folder)` and publish it under a fresh id."""
        entry_id = uuid.uuid4().hex
        staging = self.root / f".staging-{entry_id}"
        staging.mkdir()
        try:
            with disk_errors():
                build(staging)
            meta = {"labels": {**labels, OWNER_LABEL: OWNER}, "created_at": dt.datetime.now(dt.UTC).isoformat()}
            (staging / _META).write_text(json.dumps(meta))
            os.rename(staging, self.root / entry_id)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return entry_id

    def path(self, entry_id: str) -> Path | None:
        """The entry's folder, or None for an unknown or malformed id (never a path outside root)."""
        if not isinstance(entry_id, str) or not _ID.fullmatch(entry_id):
            return None
        folder = self.root / entry_id
        return folder if folder.is_dir() else None

    def labels(self, entry_id: str) -> dict[str, str]:
        folder = self.path(entry_id)
        return self._read_meta(folder)[0] if folder else {}

    def remove(self, entry_id: str) -> None:
        folder = self.path(entry_id)
        if folder is None:
            return
        doomed = self.root / f".removing-{entry_id}"
        try:
            os.rename(folder, doomed)
        except FileNotFoundError:  # removed concurrently
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def list(self, selector: Mapping[str, str] | None) -> list[OwnedResource]:
        found = []
        for name in sorted(os.listdir(self.root)):
            if not _ID.fullmatch(name):
                continue
            labels, created_at = self._read_meta(self.root / name)
            if labels_match(labels, selector):
                found.append(OwnedResource(id=name, labels=labels, created_at=created_at))
        return found

    def count(self) -> int:
        return sum(1 for name in os.listdir(self.root) if _ID.fullmatch(name))

    @staticmethod
    def _read_meta(folder: Path) -> tuple[dict[str, str], dt.datetime | None]:
        try:
            meta = json.loads((folder / _META).read_text())
        except (OSError, ValueError):  # removed meanwhile, or written by something else
            return {}, None
        created_at = meta.get("created_at")
        return meta.get("labels", {}), dt.datetime.fromisoformat(created_at) if created_at else None


def folder_size(folder: Path) -> int:
    return tree_usage(folder).bytes


@contextmanager
def disk_errors(*, full: type[DiskQuotaExceeded] = DiskQuotaExceeded) -> Iterator[None]:
    """A full disk or an over-long path as the sandbox errors the API answers with a 4xx."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise full(f"no space left for the sandbox: {exc.strerror}") from exc
        if exc.errno == errno.ENAMETOOLONG:
            raise PathTooLong(f"file name too long: {exc.strerror}") from exc
        raise


@dataclass(frozen=True)
class TreeUsage:
    bytes: int  # apparent sizes of everything but folders, a hard-linked file once
    entries: int
    too_deep: bool = False  # folders nested deeper than the walk goes: bytes and entries undercount


def tree_usage(
    root: str | Path, *, stop_bytes: int | None = None, stop_entries: int | None = None, max_depth: int = 128
) -> TreeUsage:
    """What a folder holds, walked by hostfs.walk (descriptors, lstat, O_NOFOLLOW): a tree that
    another party changes meanwhile (a sandbox's layer) can never lead the walk through a link or
    out of `root`. Stops early, with what it counted, once past `stop_bytes` or `stop_entries`;
    folders deeper than `max_depth` are not entered."""
    total = entries = 0
    linked: set[tuple[int, int]] = set()
    skipped: list[str] = []
    walker = hostfs.walk(str(root), max_depth=max_depth, too_deep=skipped.append)
    for _, st in walker:
        entries += 1
        if stat.S_ISDIR(st.st_mode):
            continue
        if st.st_nlink < 2 or (st.st_dev, st.st_ino) not in linked:
            if st.st_nlink > 1:
                linked.add((st.st_dev, st.st_ino))
            total += st.st_size
        if (stop_bytes is not None and total > stop_bytes) or (stop_entries is not None and entries > stop_entries):
            walker.close()
            break
    return TreeUsage(total, entries, bool(skipped))
