"""Reads of projects: their tokens (never the keys) and their request rate."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.utils import timezone

from accounts.models import ApiToken, Project, ProjectRequests


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
