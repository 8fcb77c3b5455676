"""Fixtures of the cache's tests."""

from __future__ import annotations

import pytest
from django.conf import settings

from accounts.services import tokens
from cache.services.hitcache import HitCache, hit_cache, hit_cache_reset


@pytest.fixture
def hit_cache_window(monkeypatch):
    """The cache with a window of `ms` (default a minute: a lease never lapses in a test), and
    tokens verified for the whole test, so that a counted request's statements are its own."""
    monkeypatch.setattr(tokens, "TOKEN_CACHE_TTL_S", 600.0)

    def configure(ms: float = 60_000.0, entries: int = 16_384, mb: int = 64) -> HitCache:
        monkeypatch.setitem(settings.TVCACHE, "HIT_CACHE_WINDOW_MS", ms)
        monkeypatch.setitem(settings.TVCACHE, "HIT_CACHE_ENTRIES", entries)
        monkeypatch.setitem(settings.TVCACHE, "HIT_CACHE_MB", mb)
        hit_cache_reset()
        return hit_cache()

    yield configure
    hit_cache_reset()
