"""Docker backends of the tests' own configuration (no Django settings)."""

from __future__ import annotations

from sandboxes.backends.config import DockerConfig
from sandboxes.backends.docker import DockerBackend


def make_docker_backend(**config: object) -> DockerBackend:
    return DockerBackend(DockerConfig(**config))  # type: ignore[arg-type]
