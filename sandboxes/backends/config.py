"""Backend configuration as frozen (hashable) dataclasses; Django settings are mapped onto them elsewhere."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class DockerConfig:
    base_url: str | None = None  # None: DOCKER_HOST or the local socket, as the docker CLI does
    default_image: str = "tvcache/busybox:latest"
    memory_mb: int = 512
    cpus: float = 1.0
    pids: int = 256
    # Past this many concurrent container creations the engine slows down for everyone.
    max_concurrent_starts: int = 4
    output_cap_bytes: int = 64 * 1024  # kept per stream (stdout, stderr); the rest is dropped
    # A command still printing past this is killed rather than drained until its timeout.
    output_kill_bytes: int = 16 * 1024 * 1024
    default_timeout_s: float = 120.0
    max_timeout_s: float = 3600.0
    api_timeout_s: float = 60.0
    # Engine connections kept per process: one per concurrent call or start, past that they churn.
    api_pool_size: int = 32
    # Tell read-only bash calls from their container's layer on the host (overlay.py).
    observe_writes: bool = True
    observe_max_entries: int = 20_000  # past this many files in a sandbox's layer, stop (overlay.py)
    fingerprint_max_bytes: int = 512 << 20  # past this much changed content, a state is not fingerprinted


@dataclass(frozen=True)
class DirectoryConfig:
    max_read_bytes: int = 1024 * 1024
    max_write_bytes: int = 8 * 1024 * 1024


@dataclass(frozen=True)
class SqliteConfig:
    statement_timeout_s: float = 10.0
    seed_timeout_s: float = 120.0
    max_rows: int = 1000
    max_result_bytes: int = 1024 * 1024


@dataclass(frozen=True)
class SandboxConfig:
    """Everything `backend_for` needs; local backends keep their files under root/<backend>/."""

    root: Path
    docker: DockerConfig = field(default_factory=DockerConfig)
    directory: DirectoryConfig = field(default_factory=DirectoryConfig)
    sqlite: SqliteConfig = field(default_factory=SqliteConfig)
