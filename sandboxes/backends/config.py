"""Backend configuration as frozen (hashable) dataclasses; Django settings are mapped onto them elsewhere."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# The base images `manage.py build_images` builds (sandboxes/images.py): the images a task may
# name unless the operator lists others.
BUSYBOX_TAG = "tvcache/busybox:latest"
DEBIAN_TAG = "tvcache/debian:bookworm"


@dataclass(frozen=True)
class DockerConfig:
    base_url: str | None = None  # None: DOCKER_HOST or the local socket, as the docker CLI does
    # The engine (URL) whose images this one runs, by id, so that every engine of a deployment runs
    # the images its env fingerprints name; one missing here is moved (docker save | docker load).
    # None: this engine's own images.
    images_from: str | None = None
    default_image: str = BUSYBOX_TAG
    # The images a task may name (the default image always); never a snapshot image.
    images: tuple[str, ...] = (BUSYBOX_TAG, DEBIAN_TAG)
    # Defaults for a task that sets no limits, and the most a task may ask for (more is refused).
    memory_mb: int = 512
    cpus: float = 1.0
    pids: int = 256
    max_memory_mb: int = 4096
    max_cpus: float = 4.0
    max_pids: int = 1024
    allow_network: bool = False  # a task asking for network without this grant is refused
    # "uid[:gid]" for tasks that name none; "" runs the image's user (root). A non-root default is
    # a floor: tasks may then name another non-root user, never root.
    user: str = ""
    # Resource limits of every process in the container (0: not set). nproc counts a uid's
    # processes across the whole host, not per container: the pids limit bounds a container.
    ulimit_nofile: int = 4096
    ulimit_nproc: int = 0
    ulimit_fsize_mb: int = 0  # 0: the disk quota (one file can never exceed it)
    # Disk quota of a container's own layer (0: none): an overlay size limit where the engine
    # supports one, and a host-side measure of the layer after each call and every
    # `disk_check_s` (stretched for large layers); past the quota the sandbox is removed.
    disk_mb: int = 4096
    disk_max_files: int = 500_000
    disk_check_s: float = 2.0
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
    # (entries, path bytes): the most file times a call keeps for its node; the service passes the
    # REST contract's (cache.inputs.MAX_FILE_TIMES, MAX_FILE_TIMES_PATHS). None: no cap.
    file_times_max: tuple[int, int] | None = None
    # Run bash calls through one session agent per container (docker/agent.py) rather than a
    # `docker exec` each. A caller that stands for a trainer's own `docker exec` asks for False.
    session: bool = True
    # The OCI runtime of sandboxes whose task names none, and the runtimes a task may name
    # (`"runtime": "runsc"`: gVisor); each must be configured in the engine (docs/operations/runtimes.md).
    runtime: str = "runc"
    runtimes: tuple[str, ...] = ("runc", "runsc")
    # Runtimes whose snapshots are checkpoints, keeping processes and memory (docker/checkpoint.py):
    # runsc checkpoints by itself; runc only where CRIU works on the engine's kernel (`criu check`).
    checkpoint_runtimes: tuple[str, ...] = ("runsc",)


@dataclass(frozen=True)
class DirectoryConfig:
    max_read_bytes: int = 1024 * 1024
    max_write_bytes: int = 8 * 1024 * 1024
    max_total_bytes: int = 256 * 1024 * 1024  # a sandbox's files together


@dataclass(frozen=True)
class SqliteConfig:
    statement_timeout_s: float = 10.0
    seed_timeout_s: float = 120.0
    max_rows: int = 1000
    max_result_bytes: int = 1024 * 1024
    max_value_bytes: int = 4 * 1024 * 1024  # one string, blob or row (SQLITE_LIMIT_LENGTH)
    max_sql_bytes: int = 1024 * 1024  # one statement's text (SQLITE_LIMIT_SQL_LENGTH)
    max_db_bytes: int = 256 * 1024 * 1024  # the database file (max_page_count)


@dataclass(frozen=True)
class SandboxConfig:
    """Everything `backend_for` needs; local backends keep their files under root/<backend>/."""

    root: Path
    docker: DockerConfig = field(default_factory=DockerConfig)
    directory: DirectoryConfig = field(default_factory=DirectoryConfig)
    sqlite: SqliteConfig = field(default_factory=SqliteConfig)
