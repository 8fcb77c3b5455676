"""Registering an upstream, and the secret path trainers reach it by."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from cache.models import Rollout
from core.errors import InvalidInput, NotFound
from upstreams.models import Upstream

FIELDS = {
    "protocol",
    "url",
    "task_fields",
    "action_pattern",
    "read_only",
    "ignore_fields",
    "timeout_s",
    "rotate_secret",
}
# What the calls, tasks and the upstream's trajectory state depend on: changing any of these
# takes the upstream's live trajectories off the shared graph.
CALL_SHAPE = ("url", "task_fields", "action_pattern", "read_only", "ignore_fields")
MAX_FIELDS, MAX_FIELD, MAX_PATTERN, MAX_TIMEOUT_S = 100, 200, 2000, 3600.0
PROXY_PATH = "/verl-tool/{secret}/get_observation"


def proxy_secret(upstream: Upstream) -> str:
    """The secret in the upstream's proxy path: derived from its nonce with the service's
    SECRET_KEY, so that it can be shown again without being stored (only its digest is)."""
    mac = hmac.new(
        settings.SECRET_KEY.encode(), b"tvcache upstream proxy\0" + upstream.secret_nonce.encode(), hashlib.sha256
    ).digest()
    return base64.urlsafe_b64encode(mac[:24]).decode()


def secret_digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def proxy_path(upstream: Upstream) -> str:
    return PROXY_PATH.format(secret=proxy_secret(upstream))


def upstream_by_secret(*, secret: str) -> Upstream:
    """The upstream whose proxy path carries `secret`. Looked up by the secret's digest: the
    index comparison sees a hash, never the secret (no timing hint about it)."""
    upstream = Upstream.objects.select_related("project").filter(secret_digest=secret_digest(secret)).first()
    if upstream is None:
        raise NotFound("No upstream has this proxy path.", code="unknown_upstream")
    return upstream


def _new_secret(upstream: Upstream) -> None:
    upstream.secret_nonce = secrets.token_hex(16)
    upstream.secret_digest = secret_digest(proxy_secret(upstream))


def _invalid(message: str, code: str, field: str) -> InvalidInput:
    return InvalidInput(message, code=code, details={"field": field})


def _field_names(data: dict, field: str, required: bool) -> list[str]:
    value = data.get(field)
    if value is None and not required:
        return []
    if (
        not isinstance(value, list)
        or len(value) > MAX_FIELDS
        or not all(isinstance(name, str) and 0 < len(name) <= MAX_FIELD for name in value)
    ):
        raise _invalid(
            f"'{field}' must be a list of at most {MAX_FIELDS} field names (non-empty strings).",
            "invalid_fields",
            field,
        )
    return list(dict.fromkeys(value))


def _url(value: Any) -> str:
    parts = urlsplit(value) if isinstance(value, str) and len(value) <= 2000 else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise _invalid("'url' must be an http(s) URL of the upstream's get_observation endpoint.", "invalid_url", "url")
    return value


def _pattern(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MAX_PATTERN:
        raise _invalid(
            f"'action_pattern' must be a regular expression of at most {MAX_PATTERN} characters.",
            "invalid_pattern",
            "action_pattern",
        )
    try:
        re.compile(value)
    except re.error as exc:
        raise InvalidInput(
            f"'action_pattern' does not compile: {exc}",
            code="invalid_pattern",
            details={"field": "action_pattern", "position": exc.pos},
        ) from None
    return value


def _flag(data: dict, field: str) -> bool:
    value = data.get(field, False)
    if not isinstance(value, bool):
        raise _invalid(f"'{field}' must be a boolean.", "invalid_payload", field)
    return value


def _timeout(value: Any) -> float:
    if value is None:
        return Upstream._meta.get_field("timeout_s").default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
        raise _invalid(
            f"'timeout_s' must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:g}.",
            "invalid_payload",
            "timeout_s",
        )
    return float(value)


def upstream_config(data: Any) -> dict[str, Any]:
    """A PUT's body, checked: the upstream's configuration, each field of it."""
    if not isinstance(data, dict):
        raise InvalidInput("The request body must be a JSON object.", code="invalid_payload")
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise InvalidInput(
            f"Unknown field '{unknown[0]}'.",
            code="unknown_field",
            details={"field": unknown[0], "allowed": sorted(FIELDS)},
        )
    for field in ("protocol", "url", "task_fields"):
        if field not in data:
            raise _invalid(f"Missing field '{field}'.", "missing_field", field)
    if data["protocol"] not in Upstream.Protocol.values:
        raise InvalidInput(
            f"Unknown protocol {data['protocol']!r}.",
            code="unknown_protocol",
            details={"field": "protocol", "allowed": Upstream.Protocol.values},
        )
    return {
        "protocol": data["protocol"],
        "url": _url(data["url"]),
        "task_fields": _field_names(data, "task_fields", True),
        "action_pattern": _pattern(data.get("action_pattern")),
        "read_only": _flag(data, "read_only"),
        "ignore_fields": _field_names(data, "ignore_fields", False),
        "timeout_s": _timeout(data.get("timeout_s")),
    }


@transaction.atomic
def upstream_put(*, project_id: int, name: str, data: Any) -> tuple[Upstream, bool]:
    """Create or update the project's upstream `name`. A change of what shapes its calls or holds its trajectories'
    state (the URL, the fields, the pattern, read_only) detaches its live trajectories: their
    histories were made under the old configuration. `rotate_secret` makes a new proxy path."""
    if len(name) > Upstream._meta.get_field("name").max_length:
        raise _invalid("The upstream's name is too long (100 characters at most).", "invalid_name", "name")
    config = upstream_config(data)
    rotate = _flag(data, "rotate_secret")
    upstream = Upstream.objects.select_for_update().filter(project_id=project_id, name=name).first()
    created = upstream is None
    if created:
        upstream = Upstream(project_id=project_id, name=name)
        _new_secret(upstream)
    elif any(getattr(upstream, field) != config[field] for field in CALL_SHAPE):
        upstream_trajectories_detach(upstream=upstream, reason="the upstream's configuration changed")
    if rotate and not created:
        _new_secret(upstream)
    for field, value in config.items():
        setattr(upstream, field, value)
    upstream.save()
    return upstream, created


def upstream_trajectories_detach(*, upstream: Upstream, reason: str) -> int:
    return Rollout.objects.filter(
        trajectory__upstream=upstream, finished_at__isnull=True, detached_at__isnull=True
    ).update(detached_at=timezone.now(), detached_reason=reason)
