"""One Docker engine as the backend reaches it: an API client connected on first use, the cap on
concurrent container starts, the errors of an engine that is down, and what it offers sandboxes
(runtimes, checkpoints)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import docker
import docker.errors
import requests.exceptions

from ..base import EngineUnavailable
from ..config import DockerConfig

ENGINE_DOWN = (requests.exceptions.ConnectionError, requests.exceptions.Timeout)


@contextmanager
def engine_errors() -> Iterator[None]:
    """Turns a dead or unreachable engine into EngineUnavailable; API errors pass through."""
    try:
        yield
    except ENGINE_DOWN as exc:
        raise EngineUnavailable(f"docker engine unreachable: {exc}") from exc


class StartLimiter:
    """Caps concurrent container creations: past the engine's saturation point every start slows."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._slots = threading.BoundedSemaphore(capacity)
        self._lock = threading.Lock()
        self.in_flight = 0

    @contextmanager
    def slot(self) -> Iterator[None]:
        with self._slots:
            with self._lock:
                self.in_flight += 1
            try:
                yield
            finally:
                with self._lock:
                    self.in_flight -= 1


class EngineConnection:
    """The engine's API client, connected on first use, so a backend can be built while the
    engine is still down."""

    def __init__(self, config: DockerConfig):
        self.config = config
        self._client: docker.DockerClient | None = None
        self._lock = threading.Lock()

    @property
    def api(self) -> docker.APIClient:
        return self.client.api

    @property
    def client(self) -> docker.DockerClient:
        with self._lock:
            if self._client is None:
                options = {
                    "version": "auto",
                    "timeout": self.config.api_timeout_s,
                    "max_pool_size": self.config.api_pool_size,
                }
                try:
                    if self.config.base_url:
                        self._client = docker.DockerClient(base_url=self.config.base_url, **options)
                    else:
                        self._client = docker.from_env(**options)
                except docker.errors.DockerException as exc:
                    where = self.config.base_url or "DOCKER_HOST / the default socket"
                    raise EngineUnavailable(f"cannot reach the docker engine at {where}: {exc}") from exc
            return self._client


@dataclass(frozen=True)
class EngineFacts:
    """What an engine offers sandboxes beyond its API: its runtimes (name -> the arguments it runs
    them with), whether it serves the checkpoint API (a dockerd started with experimental
    features), and its data root (containers' folders, where a restore reads its checkpoint)."""

    runtimes: Mapping[str, tuple[str, ...]]
    checkpoints: bool
    data_root: str


class EngineFactsCache:
    """An engine's facts, read again every FACTS_TTL_S (an operator may reconfigure and restart the
    engine), and sooner when a caller needs a runtime they lack, at most every FACTS_RETRY_S."""

    FACTS_TTL_S = 60.0
    FACTS_RETRY_S = 10.0

    def __init__(self):
        self._facts: EngineFacts | None = None
        self._read_at = 0.0
        self._lock = threading.Lock()

    def get(self, api: docker.APIClient, *, wanted_runtime: str | None = None) -> EngineFacts:
        with self._lock:
            age = time.monotonic() - self._read_at
            stale = (
                self._facts is None
                or age > self.FACTS_TTL_S
                or (
                    wanted_runtime is not None
                    and wanted_runtime not in self._facts.runtimes
                    and age > self.FACTS_RETRY_S
                )
            )
            if stale:
                self._facts = _engine_facts(api)
                self._read_at = time.monotonic()
            return self._facts


def _engine_facts(api: docker.APIClient) -> EngineFacts:
    with engine_errors():
        info = api.info()
        runtimes = {name: tuple(spec.get("runtimeArgs") or ()) for name, spec in (info.get("Runtimes") or {}).items()}
        runtimes.setdefault("runc", ())
        # A dockerd started without experimental features answers the checkpoint API with an error
        # of its own; one that has it looks the (missing) container up.
        try:
            api._result(api._get(api._url("/containers/{0}/checkpoints", "tvcache-no-such-container")))
            checkpoints = True
        except docker.errors.NotFound as exc:
            checkpoints = "no such container" in str(exc.explanation or "").lower()
        except docker.errors.APIError:
            checkpoints = False
    return EngineFacts(runtimes=runtimes, checkpoints=checkpoints, data_root=info.get("DockerRootDir") or "")
