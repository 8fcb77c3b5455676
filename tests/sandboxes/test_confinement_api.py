"""What the operator does not grant is a 403, a sandbox past its disk quota a 413 (tool-server mode)."""

from __future__ import annotations

import pytest

from sandboxes import handles as runtime
from tests.support.toolserver import bash, run

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def confined(settings):
    """Settings as an operator would set them; the backends are rebuilt from them."""

    def apply(**overrides) -> None:
        settings.TVCACHE = {**settings.TVCACHE, **overrides}
        runtime.sandbox_config.cache_clear()

    yield apply
    runtime.sandbox_config.cache_clear()


def put(api, task_id: str, env: dict):
    return api.put(f"/api/v1/tasks/{task_id}", {"env": env}, format="json")


def error_of(response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


def test_a_spec_beyond_the_grants_is_a_403(api, busybox, confined):
    confined(DOCKER_MAX_MEMORY_MB=1024)
    docker = {"backend": "docker"}
    assert error_of(put(api, "net", {**docker, "network": True})) == (403, "network_not_granted")
    assert error_of(put(api, "big", {**docker, "limits": {"memory_mb": 2048}})) == (403, "limit_exceeded")
    snapshot = "tvcache/snapshot:" + "ab" * 16
    assert error_of(put(api, "snap", {**docker, "image": snapshot})) == (403, "image_not_allowed")
    assert error_of(put(api, "root", {**docker, "user": "root"})) == (400, "invalid_env")
    confined(DOCKER_ALLOW_NETWORK=True, DOCKER_IMAGES=["tvcache/busybox"])
    assert put(api, "net", {**docker, "network": True}).status_code == 201
    assert error_of(put(api, "debian", {**docker, "image": "tvcache/debian:bookworm"})) == (403, "image_not_allowed")


def test_a_call_past_the_disk_quota_is_a_413_and_the_rollout_goes_on(api, docker_task, busybox, confined):
    confined(DOCKER_DISK_MB=2)
    task = docker_task("quota")
    fill = bash(
        "dd if=/dev/zero of=/a bs=1024 count=1536 2>/dev/null; dd if=/dev/zero of=/b bs=1024 count=1536 2>/dev/null"
    )
    over = run(api, task, "r", fill, status=413)
    assert over["error"]["code"] == "disk_quota_exceeded"
    assert run(api, task, "r", bash("ls /a /b 2>&1; echo next"))["result"]["stdout"].endswith("next\n")


def test_folder_and_database_limits_are_4xx(api, confined):
    confined(DIRECTORY_MAX_MB=1, SQLITE_MAX_DB_MB=1)
    assert put(api, "files", {"backend": "directory", "files": {"a": "x"}}).status_code == 201
    long_name = {"tool": "write_file", "args": {"path": "n" * 300, "content": "x"}}
    assert run(api, "files", "r", long_name, status=400)["error"]["code"] == "path_too_long"
    too_much = {"tool": "write_file", "args": {"path": "big", "content": "x" * (2 * 2**20)}}
    assert run(api, "files", "r", too_much, status=413)["error"]["code"] == "disk_quota_exceeded"
    assert error_of(put(api, "seed", {"backend": "directory", "files": {"big": "x" * (2 * 2**20)}})) == (
        403,
        "limit_exceeded",
    )

    assert put(api, "db", {"backend": "sqlite", "schema_sql": "create table t (b blob);"}).status_code == 201
    grow = {
        "tool": "execute",
        "args": {
            "sql": "insert into t select randomblob(400000) union all select randomblob(400000)"
            " union all select randomblob(400000)"
        },
    }
    assert run(api, "db", "r", grow, status=413)["error"]["code"] == "disk_quota_exceeded"
