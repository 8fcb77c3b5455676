"""Reads of upstreams, and the one check of who may see or change one."""

from __future__ import annotations

from typing import Any

from accounts.projects import role_check
from core.errors import NotFound
from upstreams.models import Upstream

STATS = ("hits", "misses", "passed_through", "upstream_requests", "upstream_errors")


def upstream_for(*, principal: Any, name: str, write: bool = False) -> Upstream | None:
    """The upstream `name` of the principal's project, or None if it has none such (another
    project's upstream is not found: a 404, never a 403). `write`: changing an upstream that
    exists takes the maintainer role (accounts.projects: 403 maintainer_required), as changing a
    task does; registering a new one does not."""
    upstream = Upstream.objects.filter(project_id=principal.project_id, name=name).first()
    if upstream is not None and write:
        role_check(principal=principal, action="change an existing upstream")
    return upstream


def upstream_get(*, principal: Any, name: str) -> Upstream:
    upstream = upstream_for(principal=principal, name=name)
    if upstream is None:
        raise NotFound(f"Unknown upstream '{name}'.", code="unknown_upstream", details={"name": name})
    return upstream


def upstream_stats(*, upstream: Upstream) -> dict[str, int]:
    """Counted in actions: hits (answered from the graph), misses (looked up, sent to the upstream),
    passed_through (sent as they are: finish, pattern mismatch, off-graph trajectories); and HTTP
    requests to the upstream (catch-up included) and those that failed."""
    stats = {key: getattr(upstream, key) for key in STATS}
    stats["trajectories"] = upstream.trajectories.count()
    return stats
