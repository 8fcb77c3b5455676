"""What every dashboard page shows whatever it is about: a banner while background work waits with
no worker to take it (core.background.backlog; the same as /readyz and /metrics say)."""

from __future__ import annotations

from django.utils.functional import SimpleLazyObject

from core.background import Backlog, backlog
from core.ttl import TTLCache

BACKLOG_TTL_S = 5.0  # one Redis round trip per process every few seconds, not per page
_backlog: TTLCache[str, Backlog | bool] = TTLCache()


def background(request) -> dict:
    """`background`: the default queue's Backlog (None when embedded), read only by a page that
    renders it."""
    return {"background": SimpleLazyObject(_cached) if request.path[:5] != "/api/" else None}


def _cached() -> Backlog | bool:
    found = _backlog.get("default")
    if found is None:
        found = backlog() or False  # (a SimpleLazyObject cannot stand for None)
        _backlog.put("default", found, BACKLOG_TTL_S)
    return found
