"""The process's backends and sandbox handles, configured from settings."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from django.conf import settings

from cache import inputs
from core.errors import ApplicationError, Conflict, Forbidden, InvalidInput, PayloadTooLarge, ServiceUnavailable
from sandboxes.backends import BACKEND_NAMES, DirectoryConfig, DockerConfig, SandboxConfig, SqliteConfig, backend_for
from sandboxes.backends.base import (
    DiskQuotaExceeded,
    EngineUnavailable,
    ImageNotAllowed,
    InvalidEnv,
    InvalidToolArgs,
    LimitExceeded,
    NetworkNotGranted,
    NotGranted,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxGone,
    SandboxTampered,
    SnapshotInfo,
    ToolNotFound,
)
from sandboxes.backends.docker import DockerEnv, allowed_images
from sandboxes.backends.hostfs import StateDigest
from sandboxes.engines import engine_lost, engine_named, engines

TASK_LABEL = "tvcache.task"
SANDBOX_LABEL = "tvcache.sandbox"
# Which service's database knows the sandbox: the reaper of one installation (or of the test
# database) never touches another's sandboxes on the same engine.
INSTANCE_LABEL = "tvcache.instance"

_handles: dict[tuple[str, str], Sandbox] = {}
_handles_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def sandbox_config() -> SandboxConfig:
    conf = settings.TVCACHE
    images = {"images": tuple(conf["DOCKER_IMAGES"])} if conf["DOCKER_IMAGES"] else {}  # else the base images
    return SandboxConfig(
        root=Path(conf["SANDBOX_ROOT"]),
        docker=DockerConfig(
            base_url=engines()[0].url or None,
            max_concurrent_starts=conf["DOCKER_MAX_CONCURRENT_STARTS"],
            memory_mb=conf["DOCKER_MEMORY_MB"],
            cpus=conf["DOCKER_CPUS"],
            pids=conf["DOCKER_PIDS"],
            max_memory_mb=conf["DOCKER_MAX_MEMORY_MB"],
            max_cpus=conf["DOCKER_MAX_CPUS"],
            max_pids=conf["DOCKER_MAX_PIDS"],
            allow_network=conf["DOCKER_ALLOW_NETWORK"],
            user=conf["DOCKER_USER"],
            ulimit_nofile=conf["DOCKER_ULIMIT_NOFILE"],
            ulimit_nproc=conf["DOCKER_ULIMIT_NPROC"],
            ulimit_fsize_mb=conf["DOCKER_ULIMIT_FSIZE_MB"],
            disk_mb=conf["DOCKER_DISK_MB"],
            disk_max_files=conf["DOCKER_DISK_MAX_FILES"],
            disk_check_s=conf["DOCKER_DISK_CHECK_S"],
            **images,
            observe_writes=conf["DOCKER_OBSERVE_WRITES"],
            observe_max_entries=conf["DOCKER_OBSERVE_MAX_ENTRIES"],
            session=conf["DOCKER_SESSION"],
            file_times_max=(inputs.MAX_FILE_TIMES, inputs.MAX_FILE_TIMES_PATHS),  # what a record may carry
            runtime=conf["DOCKER_RUNTIME"],
            runtimes=tuple(conf["DOCKER_RUNTIMES"]),
            checkpoint_runtimes=tuple(conf["DOCKER_CHECKPOINT_RUNTIMES"]),
        ),
        directory=DirectoryConfig(max_total_bytes=conf["DIRECTORY_MAX_MB"] * 2**20),
        sqlite=SqliteConfig(
            max_value_bytes=conf["SQLITE_MAX_VALUE_BYTES"], max_db_bytes=conf["SQLITE_MAX_DB_MB"] * 2**20
        ),
    )


def granted_config(config: DockerConfig, project) -> DockerConfig:
    """The service's docker configuration narrowed to a project's grants (accounts.models.Project):
    network only if both allow it, the project's images (the service's default image stays
    allowed), and the lower of each pair of maxima."""

    def lower(service, granted):
        return service if granted is None else min(service, granted)

    return dataclasses.replace(
        config,
        allow_network=config.allow_network and project.network,
        images=tuple(project.images) if project.images else config.images,
        max_memory_mb=lower(config.max_memory_mb, project.max_memory_mb),
        max_cpus=lower(config.max_cpus, project.max_cpus),
        max_pids=lower(config.max_pids, project.max_pids),
    )


def env_check_granted(env, *, project) -> None:
    """Refuse a docker env that asks for more than `project` is granted: the backend's own check
    (DockerEnv), first under the service's configuration (its refusals as they are), then under
    that configuration narrowed to the grants, with the limits the sandbox would get made explicit
    (a service default above the project's cap is refused too). NotGranted subclasses:
    network_not_granted, image_not_allowed, limit_exceeded (403)."""
    if not isinstance(env, dict) or env.get("backend") != "docker":
        return
    config = sandbox_config().docker
    spec = DockerEnv.parse(env, config)
    narrowed = granted_config(config, project)
    if narrowed == config:
        return
    try:
        DockerEnv.parse({**env, "limits": spec.limits()}, narrowed)
    except NotGranted as exc:
        raise _project_refusal(exc, project.name) from None


def env_check_project(env: dict, project) -> None:
    """env_check_granted with its refusals as API errors (cache.hooks: a task's env is checked
    when it is put)."""
    try:
        env_check_granted(env, project=project)
    except SandboxError as exc:
        raise as_application_error(exc) from None


def env_fingerprint_material(env: dict) -> dict:
    """What identifies a managed environment beyond its spec (the docker image id, the sqlite
    seed's hash): a rebuilt image is a new environment, so its tasks' old results never hit."""
    if not is_managed(env.get("backend", "external")):
        return {}
    try:
        return backend_named(env["backend"]).fingerprint_material(env)
    except SandboxError as exc:
        raise as_application_error(exc) from None


def service_images() -> list[str]:
    return sorted(allowed_images(sandbox_config().docker))


def _project_refusal(exc: NotGranted, project: str) -> NotGranted:
    how = f"an operator grants it: manage.py project_set {project} ..."
    if isinstance(exc, NetworkNotGranted):
        message = f"network access is not granted to project '{project}' ({how.replace('...', '--network on')})"
    elif isinstance(exc, ImageNotAllowed):
        message = f"project '{project}' may not use this image ({how.replace('...', '--images ...')})"
    elif isinstance(exc, LimitExceeded) and isinstance(exc.details, dict):
        message = (
            f"limits.{exc.details.get('limit')} may be at most {exc.details.get('max')} in project '{project}' "
            f"(the sandbox would get {exc.details.get('requested')})"
        )
    else:
        message = f"{exc.message} (project '{project}')"
    details = {**exc.details, "project": project} if isinstance(exc.details, dict) else {"project": project}
    return type(exc)(message, details=details)


def is_managed(backend_name: str) -> bool:
    return backend_name in BACKEND_NAMES


def backend_named(name: str) -> SandboxBackend:
    if not is_managed(name):
        raise InvalidInput(
            f"Backend '{name}' is not run by the service: its sandboxes belong to the trainer (client mode).",
            code="not_managed",
        )
    return backend_for(name, sandbox_config())


def engine_backend(name: str, engine: str) -> SandboxBackend:
    """The backend `name` on the docker engine named `engine` (engines.py), which runs the first
    engine's images; the other backends run on this host."""
    if name != "docker":
        return backend_named(name)
    found, first = engine_named(engine), engines()[0]
    if found is None:
        raise EngineUnavailable(f"engine {engine!r} is not one of this service's (TVCACHE_DOCKER_ENGINES)")
    config = sandbox_config()
    docker = dataclasses.replace(
        config.docker, base_url=found.url or None, images_from=None if found == first else first.url
    )
    return backend_for(name, dataclasses.replace(config, docker=docker))


def sandbox_backend(row) -> SandboxBackend:
    """The backend holding a sandbox's or a snapshot's row (sandboxes.models.Sandbox,
    cache.models.Snapshot): on the row's engine."""
    return engine_backend(row.backend, row.engine)


def instance_selector() -> dict[str, str]:
    return {INSTANCE_LABEL: str(settings.DATABASES["default"]["NAME"])}


def labels(task_id: str, sandbox_id: int | None = None) -> dict[str, str]:
    out = {TASK_LABEL: task_id, **instance_selector()}
    if sandbox_id is not None:
        out[SANDBOX_LABEL] = str(sandbox_id)
    return out


def handle(backend: SandboxBackend, ref: str) -> Sandbox:
    """A handle on a running sandbox; cached per process (docker probes cost an exec)."""
    key = (backend.name, ref)
    with _handles_lock:
        cached = _handles.get(key)
    if cached is not None:
        return cached
    sandbox = backend.attach(ref)
    with _handles_lock:
        _handles[key] = sandbox
    return sandbox


def sandbox_handle(row) -> Sandbox:
    """A handle on the running sandbox of a row (sandboxes.models.Sandbox)."""
    if row.backend == "docker" and engine_named(row.engine) is None:
        raise SandboxGone(f"its engine {row.engine!r} is no longer one of this service's (TVCACHE_DOCKER_ENGINES)")
    with engine_loss(row.engine):
        sandbox = handle(sandbox_backend(row), row.ref)
    return PlacedSandbox(sandbox, row.engine) if len(engines()) > 1 else sandbox


@contextmanager
def engine_loss(engine: str) -> Iterator[None]:
    """An engine that fails is left out of placements for a while. With other engines to take
    their rollouts, its sandboxes are gone (SandboxGone: a rollout goes on from its history on
    another engine); else the engine is unavailable (503 until it is back)."""
    try:
        yield
    except EngineUnavailable as exc:
        engine_lost(engine)
        if len(engines()) > 1:
            raise SandboxGone(f"its engine failed: {exc.message}") from exc
        raise


class PlacedSandbox(Sandbox):
    """A sandbox on one engine of several: its engine's failure is its death (engine_loss)."""

    def __init__(self, sandbox: Sandbox, engine: str):
        self.sandbox = sandbox
        self.engine = engine
        self.sandbox_id = sandbox.sandbox_id

    def execute(self, tool: str, args: Mapping[str, Any]) -> dict[str, Any]:
        with engine_loss(self.engine):
            return self.sandbox.execute(tool, args)

    def execute_observed(self, tool: str, args: Mapping[str, Any]) -> tuple[dict[str, Any], bool | None]:
        with engine_loss(self.engine):
            return self.sandbox.execute_observed(tool, args)

    def state_fingerprint(self) -> StateDigest | None:
        with engine_loss(self.engine):
            return self.sandbox.state_fingerprint()

    def restore_file_times(self, times: Mapping[str, int]) -> None:
        with engine_loss(self.engine):
            self.sandbox.restore_file_times(times)

    def state_drifted(self) -> bool:
        return self.sandbox.state_drifted()

    def observed_ms(self) -> float:
        return self.sandbox.observed_ms()

    @property
    def keeps_processes(self) -> bool:
        return self.sandbox.keeps_processes

    def snapshot(self, *, labels: Mapping[str, str] | None = None) -> SnapshotInfo:
        with engine_loss(self.engine):
            return self.sandbox.snapshot(labels=labels)

    def stop(self) -> None:
        with engine_loss(self.engine):
            self.sandbox.stop()

    def alive(self) -> bool:
        try:
            with engine_loss(self.engine):
                return self.sandbox.alive()
        except SandboxGone:
            return False


def remember(backend: SandboxBackend, sandbox: Sandbox) -> Sandbox:
    with _handles_lock:
        _handles[(backend.name, sandbox.sandbox_id)] = sandbox
    return sandbox


def forget(backend_name: str, ref: str) -> None:
    with _handles_lock:
        _handles.pop((backend_name, ref), None)


def as_application_error(exc: SandboxError) -> ApplicationError:
    """Sandbox failures as API errors: the caller's fault is a 400, more than the operator grants a
    403, a sandbox past its disk quota a 413, the machine's fault a 503."""
    if isinstance(exc, NotGranted):
        return Forbidden(exc.message, code=exc.code, details=exc.details)
    if isinstance(exc, DiskQuotaExceeded):
        return PayloadTooLarge(exc.message, code=exc.code, details=exc.details)
    if isinstance(exc, (ToolNotFound, InvalidToolArgs, InvalidEnv)):
        return InvalidInput(exc.message, code=exc.code, details=exc.details)
    if isinstance(exc, SandboxTampered):  # the rollout's own doing: its sandbox is retired
        return Conflict(exc.message, code=exc.code, details=exc.details)
    return ServiceUnavailable(exc.message, code=exc.code, details=exc.details)
