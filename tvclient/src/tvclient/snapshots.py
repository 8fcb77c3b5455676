"""Frozen environments of one trainer process, by the snapshot ref registered with the service."""

from __future__ import annotations

import threading

from .environment import ToolExecutionEnvironment


class SnapshotStore:
    """Process-local registry ref -> frozen environment, shared by a process's executors.

    A frozen environment is never executed on, only forked. Executors of one process may run
    in threads, hence the lock. Forking a snapshot while another executor evicts it cannot
    happen: the forking executor holds the service's lease, and leased snapshots are never
    evicted.
    """

    def __init__(self) -> None:
        self._frozen: dict[str, ToolExecutionEnvironment] = {}
        self._lock = threading.Lock()

    def add(self, ref: str, env: ToolExecutionEnvironment) -> None:
        with self._lock:
            self._frozen[ref] = env

    def get(self, ref: str) -> ToolExecutionEnvironment | None:
        with self._lock:
            return self._frozen.get(ref)

    def discard(self, ref: str) -> None:
        """Stop and forget the snapshot; refs this process never held are ignored."""
        with self._lock:
            env = self._frozen.pop(ref, None)
        if env is not None:
            env.stop()

    def __contains__(self, ref: object) -> bool:
        with self._lock:
            return ref in self._frozen

    def __len__(self) -> int:
        with self._lock:
            return len(self._frozen)

    def close(self) -> None:
        with self._lock:
            frozen, self._frozen = list(self._frozen.values()), {}
        for env in frozen:
            env.stop()
