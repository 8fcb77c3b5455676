"""Sandbox backends behind one interface (`base.py`), looked up by the name in a task's env spec.

    backend = backend_for(env["backend"], config)   # config: a SandboxConfig
    with backend.start(env, labels={"tvcache.task": task_id}) as sandbox:
        sandbox.execute("bash", {"command": "make test"})

Instances are cached per (name, configuration): a backend holds an engine connection pool and
the docker start limiter, which must be shared by every caller in the process.
"""

from __future__ import annotations

import threading

from .base import InvalidEnv, SandboxBackend
from .config import DirectoryConfig, DockerConfig, SandboxConfig, SqliteConfig
from .directory import DirectoryBackend
from .docker import DockerBackend
from .sqlite import SqliteBackend

__all__ = ["BACKEND_NAMES", "DirectoryConfig", "DockerConfig", "SandboxConfig", "SqliteConfig", "backend_for"]

BACKEND_NAMES = ("docker", "directory", "sqlite")
_instances: dict[tuple[str, object], SandboxBackend] = {}
_lock = threading.Lock()


def backend_for(name: str, config: SandboxConfig) -> SandboxBackend:
    """The process's backend for `name` under `config`. Raises InvalidEnv for an unknown name."""
    if name not in BACKEND_NAMES:
        # "external" tasks have trainer-owned sandboxes: the service never runs them.
        raise InvalidEnv(f"no sandbox backend {name!r}; the service runs {', '.join(BACKEND_NAMES)}")
    key = (name, _backend_config(name, config))
    with _lock:
        if key not in _instances:
            _instances[key] = _build(name, config)
        return _instances[key]


def _backend_config(name: str, config: SandboxConfig) -> object:
    if name == "docker":
        return config.docker
    return (config.root, getattr(config, name))


def _build(name: str, config: SandboxConfig) -> SandboxBackend:
    if name == "docker":
        return DockerBackend(config.docker)
    if name == "directory":
        return DirectoryBackend(config.root / "directory", config.directory)
    return SqliteBackend(config.root / "sqlite", config.sqlite)
