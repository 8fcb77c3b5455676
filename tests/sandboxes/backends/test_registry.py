"""backend_for: one cached backend per name and configuration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sandboxes.backends import SandboxConfig, SqliteConfig, backend_for
from sandboxes.backends.base import InvalidEnv
from sandboxes.backends.directory import DirectoryBackend
from sandboxes.backends.docker import DockerBackend


def test_backends_are_cached_per_name_and_config(tmp_path):
    config = SandboxConfig(root=tmp_path)
    directory = backend_for("directory", config)
    assert isinstance(directory, DirectoryBackend)
    assert backend_for("directory", SandboxConfig(root=tmp_path)) is directory
    assert isinstance(backend_for("docker", config), DockerBackend)
    # A change to another backend's settings keeps this one; a change to its own does not.
    assert backend_for("directory", SandboxConfig(root=tmp_path, sqlite=SqliteConfig(max_rows=1))) is directory
    assert backend_for("sqlite", SandboxConfig(root=tmp_path, sqlite=SqliteConfig(max_rows=1))) is not backend_for(
        "sqlite", config
    )


def test_sandboxes_of_each_local_backend_live_under_the_root(tmp_path):
    sandbox = backend_for("sqlite", SandboxConfig(root=tmp_path)).start({"backend": "sqlite"}, labels={})
    assert (tmp_path / "sqlite" / "sandboxes" / sandbox.sandbox_id).is_dir()


@pytest.mark.parametrize("name", ["external", "kubernetes"])
def test_unknown_backends_are_refused(tmp_path, name):
    with pytest.raises(InvalidEnv):
        backend_for(name, SandboxConfig(root=tmp_path))


def test_backends_import_no_django():
    # They run in Celery workers and tests without settings; a subprocess sees a clean import.
    code = "import sys, sandboxes.backends, sandboxes.images; print(sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'rest_framework')))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[3]
    )
    assert result.stdout.strip() == "[]"
