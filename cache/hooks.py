"""What the cache asks of the sandbox backends without importing them: the sandboxes app sits above
the cache, so it registers its answers when Django starts (`SandboxesConfig.ready`) and the cache
calls through them. Asking before they are registered is a programming error, never a default: a
fingerprint without its backend's material would let a rebuilt image hit its old results."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accounts.models import Project


@dataclass(frozen=True, slots=True)
class SandboxHooks:
    # What identifies an env beyond its spec (the docker image id, the sqlite seed's hash; {} for
    # an env the service does not run): part of the task's env fingerprint. Raises ApplicationError.
    fingerprint_material: Callable[[dict], dict]
    # Refuses (ApplicationError) an env that asks for more than the project is granted.
    grants_check: Callable[[dict, Project], None]


_hooks: SandboxHooks | None = None


def sandbox_hooks_register(hooks: SandboxHooks) -> None:
    global _hooks
    _hooks = hooks


def sandbox_hooks() -> SandboxHooks:
    if _hooks is None:
        raise RuntimeError("No sandbox hooks: the sandboxes app registers them at start (INSTALLED_APPS).")
    return _hooks
