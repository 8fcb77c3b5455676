"""What the integrations of one trainer process share: its client, its snapshot store, and the
digest that names tasks and uploads."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Mapping
from typing import Any

from ..client import Tools, TVCacheClient
from ..snapshots import SnapshotStore

URL_VARIABLE = "TVCACHE_URL"
TOKEN_VARIABLE = "TVCACHE_TOKEN"

_lock = threading.Lock()
_clients: dict[tuple[str, str], TVCacheClient] = {}

# Frameworks create their environments and tools themselves, so the executors they lead to
# cannot be handed a store: they all share this one, as tvclient asks of a trainer process.
snapshots = SnapshotStore()


def shared_client(url: str | None = None, token: str | None = None) -> TVCacheClient:
    """The process's client for `url` and `token`, by default `TVCACHE_URL` and `TVCACHE_TOKEN`.

    Frameworks build environments and tools from configuration (often in worker processes):
    one client per process serves them all, over its keep-alive connections.
    """
    url = url or os.environ.get(URL_VARIABLE)
    token = token or os.environ.get(TOKEN_VARIABLE)
    if not url or not token:
        raise ValueError(f"tvcache needs a service: pass a client, or set {URL_VARIABLE} and {TOKEN_VARIABLE}")
    with _lock:
        client = _clients.get((url, token))
        if client is None:
            client = _clients[(url, token)] = TVCacheClient(url, token)
        return client


def close_clients() -> None:
    """Close the process's shared clients (their keep-alive connections); later calls open new ones."""
    with _lock:
        clients = list(_clients.values())
        _clients.clear()
    for client in clients:
        client.close()


def declared_tools(read_only: frozenset[str], uncached: frozenset[str] = frozenset()) -> Tools:
    """Tool declarations: `read_only` tools change nothing; `uncached` ones change nothing and
    always run (they read the sandbox into the trainer's own files)."""
    tools: dict[str, dict[str, bool]] = {name: {"mutates_state": False} for name in read_only}
    tools.update({name: {"mutates_state": False, "cacheable": False} for name in uncached})
    return tools


def _plain(value: Any) -> Any:
    """`value` as JSON data, for digests that name things (never for results): mappings,
    sequences, numbers and strings as they are, array-likes (numpy, OmegaConf containers)
    through their own conversion, anything else as its repr."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "tolist"):  # numpy arrays and scalars, as datasets hand them over
        return _plain(value.tolist())
    if hasattr(value, "items"):
        return _plain(dict(value.items()))
    return repr(value)


_SLUG = re.compile(r"[-a-zA-Z0-9_]{1,200}")
_NOT_SLUG = re.compile(r"[^-a-zA-Z0-9_]+")


def task_slug(name: str) -> str:
    """A task id the service takes (a slug of at most 200 characters) for a framework's name.

    A name that is one already stays as it is; any other is made one and given a digest of the
    name, so that two names that slug alike ("a/b", "a.b") stay two tasks.
    """
    if _SLUG.fullmatch(name):
        return name
    return f"{_NOT_SLUG.sub('-', name).strip('-')[:180]}-{digest(name)[:16]}"


def digest(value: Any) -> str:
    """sha256 of `value`'s canonical JSON (sorted keys, no whitespace), as the service keys calls."""
    canonical = json.dumps(_plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
