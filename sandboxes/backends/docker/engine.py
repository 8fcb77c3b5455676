"""One Docker engine as the backend reaches it: an API client connected on first use, the cap on
concurrent container starts, and the errors of an engine that is down."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

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
                options = {"version": "auto", "timeout": self.config.api_timeout_s, "max_pool_size": self.config.api_pool_size}
                try:
                    if self.config.base_url:
                        self._client = docker.DockerClient(base_url=self.config.base_url, **options)
                    else:
                        self._client = docker.from_env(**options)
                except docker.errors.DockerException as exc:
                    where = self.config.base_url or "DOCKER_HOST / the default socket"
                    raise EngineUnavailable(f"cannot reach the docker engine at {where}: {exc}") from exc
            return self._client
