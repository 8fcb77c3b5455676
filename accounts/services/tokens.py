"""API tokens: made, revoked, and verified for `Authorization: Token <key>` (by the hot front door
and by DRF's authentication, accounts.api.auth). Only the key's sha256 is stored.

A token belongs to one project and has a role (accounts.projects). Verifying a key reads the token
with its project in one statement; the answer (the request's `Principal`) is kept in process for
TOKEN_CACHE_TTL_S at most, and never past the token's expiry, so a revoked or expired token is
refused within that time by every server process, and the hot path reads nothing for the
token otherwise. Each process also rate-limits each project (`admit`: a token bucket)."""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
import threading
import time
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from accounts.hooks import request_count
from accounts.models import ApiToken
from accounts.projects import DEFAULT_PROJECT, MAINTAINER, ROLES, task_key
from core.errors import RateLimited
from core.ttl import TTLCache

from .projects import project_named

# A revoked or expired token is refused within this time in every process (docs/operations/projects.md).
TOKEN_CACHE_TTL_S = 4.0
LAST_USED_EVERY_S = 60.0  # a token's last use is written at most this often
INVALID_TOKEN = "Invalid, expired or revoked token."


@dataclass(frozen=True, slots=True)
class Principal:
    """Who an API request acts as: a token of a project, with its role, and the project's rate
    limit (requests per second and burst; None: no limit)."""

    token: str
    project: str
    project_id: int
    role: str
    rate_limit: int | None = None
    rate_burst: int | None = None

    is_authenticated = True  # what DRF and Django ask of request.user
    is_staff = False

    def task_key(self, task_id: str) -> str:
        """The internal key of the project's task `task_id` (accounts.projects.task_key)."""
        return task_key(self.project, task_id)

    @property
    def maintainer(self) -> bool:
        return self.role == MAINTAINER

    def __str__(self) -> str:  # what the audit log names as the actor
        return f"token:{self.token}"


_verified: TTLCache[str, Principal] = TTLCache()  # by key digest


def key_digest(key: str) -> str:
    digest = _digests.get(key)
    if digest is None:
        digest = hashlib.sha256(key.encode()).hexdigest()
        if len(key) <= 128:  # a key is 47 characters: longer ones are not kept
            if len(_digests) >= 1024:
                _digests.clear()
            _digests[key] = digest
    return digest


# The digests of the keys this process saw lately: a hot-path request would hash its key again.
_digests: dict[str, str] = {}


def token_create(
    *, name: str, project: str = DEFAULT_PROJECT, role: str = MAINTAINER, expires_in: dt.timedelta | None = None
) -> str:
    """A new token of `project` (made if it does not exist); returns the key, which is not stored.
    The service's own tools and tests default to the default project's maintainer; the command
    line (`manage.py create_token`) asks."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}")
    key = new_key()
    with transaction.atomic():
        owner = project_named(project, create=True)
        ApiToken.objects.create(
            name=name,
            key_digest=key_digest(key),
            project=owner,
            role=role,
            expires_at=timezone.now() + expires_in if expires_in is not None else None,
        )
    return key


def new_key() -> str:
    # The prefix: a key never starts with "-" (a command line takes "--token -x..." for an
    # option; the demo's did, one run in 32) and secret scanners can tell a tvcache key.
    return "tvc_" + secrets.token_urlsafe(32)


def token_revoke(*, name: str) -> bool:
    """Revoke a token (refused everywhere within TOKEN_CACHE_TTL_S). False: no such live token."""
    return bool(ApiToken.objects.filter(name=name, revoked_at__isnull=True).update(revoked_at=timezone.now()))


def principal_cached(key: str) -> Principal | None:
    """The key's principal if it was verified lately in this process (no database read)."""
    return _verified.get(key_digest(key))


def principal_for_key(key: str) -> Principal | None:
    """The key's principal, or None for a key that is unknown, revoked or expired."""
    digest = key_digest(key)
    cached = _verified.get(digest)
    if cached is not None:
        return cached
    wall = timezone.now()
    row = (
        ApiToken.objects.filter(key_digest=digest, revoked_at__isnull=True)
        .values_list(
            "pk",
            "name",
            "role",
            "expires_at",
            "last_used_at",
            "project_id",
            "project__name",
            "project__rate_limit",
            "project__rate_burst",
        )
        .first()
    )
    if row is None or (row[3] is not None and row[3] <= wall):
        _verified.pop(digest)
        return None
    pk, name, role, expires_at, last_used_at, project_id, project, rate_limit, rate_burst = row
    principal = Principal(name, project, project_id, role, rate_limit, rate_burst)
    ttl_s = TOKEN_CACHE_TTL_S
    if expires_at is not None:
        ttl_s = min(ttl_s, (expires_at - wall).total_seconds())
    _verified.put(digest, principal, ttl_s)
    if last_used_at is None or (wall - last_used_at).total_seconds() > LAST_USED_EVERY_S:
        ApiToken.objects.filter(pk=pk).update(last_used_at=wall)
    return principal


class _Bucket:
    """A token bucket: `burst` requests at once, refilled at `rate` per second."""

    __slots__ = ("tokens", "stamp")

    def __init__(self, burst: float, stamp: float):
        self.tokens, self.stamp = burst, stamp


_buckets: dict[int, _Bucket] = {}
_buckets_lock = threading.Lock()


def admit(principal: Principal) -> None:
    """Count the request against its project's rate limit; RateLimited (429) over it. Each
    server process keeps its own buckets: with TVCACHE_RATE_LIMIT_PROCESSES = N (the number of
    server processes), each admits 1/N of the project's rate."""
    rate = principal.rate_limit
    if rate is None:
        request_count(project_id=principal.project_id, admitted=True)
        return
    share = settings.TVCACHE.get("RATE_LIMIT_PROCESSES", 1)
    rate_here = rate / share
    burst = max(1.0, (principal.rate_burst or rate) / share)
    now = time.monotonic()
    with _buckets_lock:
        bucket = _buckets.get(principal.project_id)
        if bucket is None:
            # Full as of `now`: stamped later, it would be a hair short of a request when burst is 1.
            bucket = _buckets[principal.project_id] = _Bucket(burst, now)
        bucket.tokens = min(burst, bucket.tokens + (now - bucket.stamp) * rate_here)
        bucket.stamp = now
        admitted = bucket.tokens >= 1.0
        if admitted:
            bucket.tokens -= 1.0
        wait_s = 0.0 if admitted else (1.0 - bucket.tokens) / rate_here
    request_count(project_id=principal.project_id, admitted=admitted)
    if not admitted:
        raise RateLimited(
            f"Project '{principal.project}' is over its rate limit of {rate} requests per second.",
            details={"project": principal.project, "rate_limit": rate, "retry_after_s": round(wait_s, 3)},
        )
