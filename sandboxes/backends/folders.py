"""Labelled folders on local disk: how the directory and sqlite backends keep sandboxes and snapshots.

Each entry is root/<32 hex id>/ holding `meta.json` (labels, creation time) and the backend's
payload. Entries are built in a hidden staging folder and published by one rename, and removed
by renaming them away first, so a listing never shows a half-built or half-deleted entry.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from .base import OWNER, OWNER_LABEL, OwnedResource, labels_match

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
    total = 0
    for dirpath, _dirnames, filenames in os.walk(folder):
        for name in filenames:
            total += os.lstat(os.path.join(dirpath, name)).st_size
    return total
