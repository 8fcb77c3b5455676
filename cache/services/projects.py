"""Projects, their grants and members, and their tokens (the operator's side: `manage.py
project_set`, `create_token`, `revoke_token`, `list_tokens`, and the Django admin)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from cache.errors import InvalidInput, NotFound
from cache.hooks import sandbox_hooks
from cache.models import ApiToken, Membership, Project, ProjectRequests, Snapshot
from cache.projects import DEFAULT_PROJECT, PROJECT_NAME, ROLES

# Grants a project may set (Project's fields), each null for "no bound of its own".
LIMITS = (
    "max_memory_mb",
    "max_cpus",
    "max_pids",
    "max_live_sandboxes",
    "max_snapshot_bytes",
    "rate_limit",
    "rate_burst",
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


def service_images() -> list[str]:
    """The images the service runs (a project's images are chosen among them)."""
    return sandbox_hooks().images()


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


def project_tokens(*, project: Project | None = None) -> list[dict[str, Any]]:
    """Tokens (of one project, or all) with role, expiry, last use and state; never their keys."""
    now = timezone.now()
    rows = ApiToken.objects.select_related("project").order_by("project__name", "name")
    if project is not None:
        rows = rows.filter(project=project)
    return [
        {
            "name": t.name,
            "project": t.project.name,
            "role": t.role,
            "created_at": t.created_at,
            "expires_at": t.expires_at,
            "last_used_at": t.last_used_at,
            "revoked_at": t.revoked_at,
            "state": "revoked" if t.revoked_at else "expired" if t.expires_at and t.expires_at <= now else "active",
        }
        for t in rows
    ]


def project_snapshot_bytes(*, project_id: int) -> int:
    """Bytes of the project's live snapshots (their sizes as registered)."""
    return (
        Snapshot.objects.filter(task__project_id=project_id, status=Snapshot.Status.LIVE).aggregate(
            n=Sum("size_bytes")
        )["n"]
        or 0
    )


def project_request_rate(*, project_id: int, minutes: int = 30) -> dict[str, Any]:
    """Requests per second in the last complete minute, and per minute over the last `minutes`
    (admitted, refused by the rate limit), from the counters every server process writes."""
    now = timezone.now()
    this_minute = now.replace(second=0, microsecond=0)
    rows = list(
        ProjectRequests.objects.filter(project_id=project_id, minute__gte=this_minute - dt.timedelta(minutes=minutes))
        .order_by("minute")
        .values_list("minute", "admitted", "refused")
    )
    last = next(((a, r) for m, a, r in rows if m == this_minute - dt.timedelta(minutes=1)), (0, 0))
    return {
        "per_s": round((last[0] + last[1]) / 60.0, 2),
        "refused_last_minute": last[1],
        "minutes": [{"minute": m, "admitted": a, "refused": r} for m, a, r in rows],
    }
