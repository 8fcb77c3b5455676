"""Reads of upstreams, and the one check of who may see or change one."""

from __future__ import annotations

from typing import Any

from cache.errors import NotFound
from upstreams.models import Upstream

STATS = ("hits", "misses", "passed_through", "upstream_requests", "upstream_errors")


def upstream_for(*, principal: Any, name: str, write: bool = False) -> Upstream | None:
    """The upstream `name` as `principal` may see it, or None if there is none such. The one place
    that decides access: today every trainer token sees and changes every upstream; with projects,
    a principal sees its project's upstreams only, and `write` asks for the maintainer role."""
    return Upstream.objects.filter(name=name).first()


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
