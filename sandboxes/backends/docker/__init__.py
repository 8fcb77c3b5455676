"""The docker backend: one container per sandbox, driven through the Docker Engine API.

- backend.py: `DockerBackend`, a backend on one engine: starts, forks, attach, listing, health.
- sandbox.py: `DockerSandbox`, one container: calls, observation, kills, snapshots.
- session.py: the bash tool's shell session kept inside the container across calls.
- agent.py: the session agent, one process per container that starts each call without an exec.
- execstream.py: a call's output read from docker's exec stream.
- confinement.py: `DockerEnv`, a task's env spec within the operator's grants, and what a
  container may do.
- quota.py: the disk quota on a container's own layer.
- images.py: image names, snapshot images, our labels, base layers.
- engine.py: the connection to the engine, its start limiter and its errors.
"""

from .backend import DockerBackend
from .confinement import DockerEnv, allowed_images
from .images import SHELL_LABEL
from .sandbox import DockerSandbox

__all__ = ["SHELL_LABEL", "DockerBackend", "DockerEnv", "DockerSandbox", "allowed_images"]
