"""A sandbox's disk quota on its container's own layer: an overlay size limit where the engine
enforces one (backend.py), else measured from the host after each call and every `disk_check_s`;
past the quota the sandbox is removed."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from ..base import SandboxGone
from ..config import DockerConfig
from ..folders import TreeUsage, tree_usage

if TYPE_CHECKING:
    from .sandbox import DockerSandbox

log = logging.getLogger(__name__)

# A layer of fewer entries than this (a measure of some 50 ms) is measured after every call; a
# larger one every disk_check_s, stretched to this many times what its measure costs.
_DISK_CHEAP_ENTRIES = 5_000
_DISK_COST_FACTOR = 20
_DISK_MAX_DEPTH = 128  # folders nested deeper count as over the quota: the measure cannot see them
_UNSET = object()


class DiskQuota:
    """A sandbox's disk quota, measured on its container's layer from the host (folders.tree_usage:
    no link is followed). A measure costs about 10 us per entry of the layer, so a large layer is
    measured less often. Between measures a sandbox can overshoot by what it writes meanwhile;
    the fsize ulimit keeps any one file under the quota."""

    def __init__(self, config: DockerConfig):
        self.limit_bytes = config.disk_mb * 2**20
        self.max_files = config.disk_max_files
        self.interval_s = config.disk_check_s
        self.breach: str | None = None
        self.usage: TreeUsage | None = None
        self._layer: str | None | object = _UNSET
        self._due = 0.0
        self._lock = threading.Lock()

    def measure(self, sandbox: DockerSandbox, *, after_call: bool) -> bool:
        """Whether this measure found the layer past the quota (once: later ones return False)."""
        if not self.limit_bytes or self.breach is not None:
            return False
        with self._lock:
            started = time.monotonic()
            cheap = self.usage is None or self.usage.entries < _DISK_CHEAP_ENTRIES
            if self.breach is not None or (started < self._due and not (after_call and cheap)):
                return False
            if self._layer is _UNSET:
                self._layer = sandbox.layer_dir()
            if self._layer is None:
                return False
            try:
                usage = tree_usage(
                    self._layer, stop_bytes=self.limit_bytes, stop_entries=self.max_files, max_depth=_DISK_MAX_DEPTH
                )
            except FileNotFoundError:  # the container was removed
                return False
            cost_s = time.monotonic() - started
            self._due = time.monotonic() + max(self.interval_s, _DISK_COST_FACTOR * cost_s)
            self.usage, self.breach = usage, self._breach(usage)
            return self.breach is not None

    def _breach(self, usage: TreeUsage) -> str | None:
        if usage.bytes > self.limit_bytes:
            return f"it wrote more than its disk quota of {self.limit_bytes // 2**20} MB"
        if usage.entries > self.max_files:
            return f"it made more than {self.max_files} files"
        if usage.too_deep:
            return f"it nested folders more than {_DISK_MAX_DEPTH} deep"
        return None

    def details(self) -> dict[str, Any]:
        usage = self.usage or TreeUsage(0, 0)
        return {
            "disk_mb": self.limit_bytes // 2**20,
            "max_files": self.max_files,
            "layer_bytes": usage.bytes,
            "layer_files": usage.entries,
        }


class DiskWatch:
    """One thread per backend measures the layers of the sandboxes this process holds, between their
    calls and during long ones; it ends when none is left."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._sandboxes: weakref.WeakSet[DockerSandbox] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, sandbox: DockerSandbox) -> None:
        with self._lock:
            self._sandboxes.add(sandbox)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tvcache-disk-quota", daemon=True)
                self._thread.start()

    def discard(self, sandbox: DockerSandbox) -> None:
        with self._lock:
            self._sandboxes.discard(sandbox)

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            with self._lock:
                sandboxes = list(self._sandboxes)
                if not sandboxes:
                    self._thread = None
                    return
            for sandbox in sandboxes:
                try:
                    sandbox.check_disk()
                except SandboxGone:
                    self.discard(sandbox)
                except Exception:  # noqa: BLE001 - one sandbox's failure must not stop the others' watch
                    log.exception("disk quota check of container %s failed", sandbox.sandbox_id[:12])
            del sandboxes
