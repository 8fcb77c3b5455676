"""Fixtures for the backend tests: a real Docker engine, local folders, no Django, no database."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import docker
import docker.errors
import pytest

from sandboxes.backends.base import OWNER, OWNER_LABEL
from sandboxes.backends.directory import DirectoryBackend
from sandboxes.backends.docker import DockerBackend
from sandboxes.backends.sqlite import SqliteBackend
from sandboxes.images import BUSYBOX_TAG, build_busybox_image
from tests.support.docker import make_docker_backend

# Every container and snapshot image a test run makes carries this label, so teardown finds
# them all even when a test failed halfway.
TEST_LABEL = "tvcache.test"


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as exc:
        pytest.fail(f"these tests need a running Docker engine: {exc}")
    yield client
    client.close()


@pytest.fixture(scope="session")
def busybox_image(docker_client: docker.DockerClient) -> Iterator[str]:
    """Builds tvcache/busybox if it is missing, and removes it again if this session built it."""
    built = build_busybox_image(docker_client)
    yield BUSYBOX_TAG
    if built.built:
        try:
            docker_client.images.remove(BUSYBOX_TAG)
        except docker.errors.APIError:  # another user of the engine runs it now: leave it
            pass


@pytest.fixture
def test_labels(docker_client: docker.DockerClient) -> Iterator[dict[str, str]]:
    run_id = uuid.uuid4().hex
    yield {TEST_LABEL: run_id}
    selector = {"label": [f"{OWNER_LABEL}={OWNER}", f"{TEST_LABEL}={run_id}"]}
    for container in docker_client.containers.list(all=True, filters=selector):
        container.remove(force=True)
    _remove_images(docker_client, [image.id for image in docker_client.images.list(filters=selector)])


def _remove_images(client: docker.DockerClient, image_ids: list[str]) -> None:
    # A snapshot of a fork is a child of the snapshot the fork ran from: children must go first,
    # and commit times are too coarse to order them, so retry until the set is empty.
    for _ in range(len(image_ids) + 1):
        for image_id in list(image_ids):
            try:
                client.images.remove(image_id, force=True)
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError:  # still has a child image: next round
                continue
            image_ids.remove(image_id)


@pytest.fixture
def docker_backend(busybox_image: str) -> DockerBackend:
    return make_docker_backend()


@pytest.fixture
def directory_backend(tmp_path) -> DirectoryBackend:
    return DirectoryBackend(tmp_path / "directory")


@pytest.fixture
def sqlite_backend(tmp_path) -> SqliteBackend:
    return SqliteBackend(tmp_path / "sqlite")
