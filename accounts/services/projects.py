"""Projects, their grants and members (the operator's side: `manage.py project_set`, and the
Django admin), and the upkeep of their request counts."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection, transaction

from accounts.hooks import service_images
from accounts.models import Membership, Project
from accounts.projects import DEFAULT_PROJECT, PROJECT_NAME, ROLES
from core.errors import InvalidInput, NotFound

# Grants a project may set (Project's fields), each null for "no bound of its own".
LIMITS = (
    "max_memory_mb",
    "max_cpus",
    "max_pids",
    "max_live_sandboxes",
    "max_snapshot_bytes",
    "rate_limit",
    "rate_burst",
    "task_max_nodes",
    "task_max_result_bytes",
)
# Caps on a sandbox's limits, and the service's maximum each must stay within.
SERVICE_MAXIMA = {"max_memory_mb": "DOCKER_MAX_MEMORY_MB", "max_cpus": "DOCKER_MAX_CPUS", "max_pids": "DOCKER_MAX_PIDS"}


def project_named(name: str, *, create: bool = False) -> Project | None:
    """The project `name` (made with `create`); the default project always exists (made again if
    something emptied the table, as a test database's flush does)."""
    if create or name == DEFAULT_PROJECT:
        if not PROJECT_NAME.fullmatch(name):
            raise InvalidInput(
                "A project name is 1 to 50 letters, digits, '-' or '_'.",
                code="invalid_project",
                details={"project": name},
            )
        project, _ = Project.objects.get_or_create(name=name, defaults={"network": name == DEFAULT_PROJECT})
        return project
    return Project.objects.filter(name=name).first()


def check_grants(grants: dict[str, Any]) -> None:
    for field, value in grants.items():
        if field == "network":
            if not isinstance(value, bool):
                raise InvalidInput("'network' is on or off.", details={"field": field})
        elif field == "images":
            if not isinstance(value, list) or not all(isinstance(i, str) and i for i in value):
                raise InvalidInput("'images' is a list of image names.", details={"field": field})
            runs = set(service_images())
            unknown = [i for i in value if i not in runs and f"{i}:latest" not in runs]
            if unknown:
                raise InvalidInput(
                    f"The service runs no image {unknown} (TVCACHE_DOCKER_IMAGES).",
                    code="image_not_allowed",
                    details={"field": field, "allowed": sorted(runs)},
                )
        elif field in LIMITS:
            if value is None:
                continue
            kind = float if field == "max_cpus" else int
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or value <= 0
                or (kind is int and not isinstance(value, int))
            ):
                raise InvalidInput(
                    f"'{field}' must be a positive {'number' if kind is float else 'integer'} (or none).",
                    details={"field": field},
                )
            most = settings.TVCACHE[SERVICE_MAXIMA[field]] if field in SERVICE_MAXIMA else None
            if most is not None and value > most:
                raise InvalidInput(
                    f"'{field}' may be at most the service's maximum, {most} (TVCACHE_{SERVICE_MAXIMA[field]}).",
                    code="limit_exceeded",
                    details={"field": field, "max": most},
                )
        else:
            raise InvalidInput(f"No grant '{field}'.", details={"field": field})


@transaction.atomic
def project_set(*, name: str, grants: dict[str, Any], members: dict[str, str | None] | None = None) -> Project:
    """Make or change a project: `grants` (Project's grant fields; None clears a limit), and
    `members` ({username: role, or None to remove}). A grant above the service's maximum, or an
    image the service does not run, is refused."""
    check_grants(grants)
    project = project_named(name, create=True)
    for field, value in grants.items():
        setattr(project, field, value)
    project.full_clean(exclude=["members"])
    project.save()
    users = get_user_model()
    for username, role in (members or {}).items():
        user = users.objects.filter(username=username).first()
        if user is None:
            raise NotFound(f"No user '{username}'.", code="unknown_user", details={"user": username})
        if role is None:
            Membership.objects.filter(project=project, user=user).delete()
        elif role not in ROLES:
            raise InvalidInput(f"A member's role is one of {ROLES}.", code="invalid_role")
        else:
            Membership.objects.update_or_create(project=project, user=user, defaults={"role": role})
    return project


def project_requests_prune(*, keep_hours: float = 24.0) -> int:
    """Delete request counts older than a day: the project page shows the last minutes."""
    with connection.cursor() as cursor:
        cursor.execute(
            "DELETE FROM accounts_projectrequests WHERE minute < now() - %s * interval '1 hour'", [keep_hours]
        )
        return cursor.rowcount
