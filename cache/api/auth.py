"""Token auth for trainers: `Authorization: Token <key>`; only the key's sha256 is stored."""

from __future__ import annotations

import hashlib
import secrets
import time

from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed

from cache.models import ApiToken

TOKEN_CACHE_TTL_S = 30.0  # a revoked token stops working within this time in every worker
_verified: dict[str, tuple[str, float]] = {}


class Trainer:
    """The authenticated principal of an API request."""

    is_authenticated = True
    is_staff = False

    def __init__(self, name: str):
        self.name = name

    def __str__(self) -> str:
        return self.name


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def token_create(*, name: str) -> str:
    # The prefix: a key never starts with "-" (a command line takes "--token -x..." for an
    # option; the demo's did, one run in 32) and secret scanners can tell a tvcache key.
    key = "tvc_" + secrets.token_urlsafe(32)
    ApiToken.objects.create(name=name, key_digest=key_digest(key))
    return key


def trainer_cached(key: str) -> bool:
    """The key was verified lately in this process (no database read)."""
    cached = _verified.get(key_digest(key))
    return cached is not None and cached[1] > time.monotonic()


def trainer_for_key(key: str) -> Trainer | None:
    digest = key_digest(key)
    cached = _verified.get(digest)
    now = time.monotonic()
    if cached and cached[1] > now:
        return Trainer(cached[0])
    name = ApiToken.objects.filter(key_digest=digest, revoked_at__isnull=True).values_list("name", flat=True).first()
    if name is None:
        _verified.pop(digest, None)
        return None
    _verified[digest] = (name, now + TOKEN_CACHE_TTL_S)
    return Trainer(name)


class TrainerTokenAuthentication(BaseAuthentication):
    keyword = b"token"

    def authenticate(self, request):
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != self.keyword:
            return None
        if len(parts) != 2:
            raise AuthenticationFailed("Authorization header must be 'Token <key>'.", code="invalid_token")
        trainer = trainer_for_key(parts[1].decode(errors="replace"))
        if trainer is None:
            raise AuthenticationFailed("Invalid or revoked token.", code="invalid_token")
        return trainer, None

    def authenticate_header(self, request):
        return "Token"
