"""What the integrations of one trainer process share: its client, its task registrations and
its snapshot store, and the digest that names tasks and uploads."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from typing import Any, Mapping

from ..client import TVCacheClient, Tools
from ..snapshots import SnapshotStore

URL_VARIABLE = "TVCACHE_URL"
TOKEN_VARIABLE = "TVCACHE_TOKEN"

_lock = threading.Lock()
_clients: dict[tuple[str, str], TVCacheClient] = {}
_registered: set[tuple[int, str, str]] = set()

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
        raise ValueError(
            f"tvcache needs a service: pass a client, or set {URL_VARIABLE} and {TOKEN_VARIABLE}"
        )
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
        _registered.clear()
    for client in clients:
        client.close()


def ensure_task(
    client: TVCacheClient,
    task_id: str,
    env: Mapping[str, Any],
    tools: Tools,
    sandbox_budget: int | None,
) -> None:
    """Create or update the task once per process and spec.

    Every rollout of the task sends the same spec, and PUT with an unchanged spec keeps the
    graph: the first rollout of the process puts it, the others need no request.
    """
    key = (id(client), task_id, digest([env, tools, sandbox_budget]))
    with _lock:
        if key in _registered:
            return
    client.put_task(task_id, env=env, tools=tools, sandbox_budget=sandbox_budget)
    with _lock:
        _registered.add(key)


def declared_tools(read_only: frozenset[str], uncached: frozenset[str] = frozenset()) -> Tools:
    """Tool declarations: `read_only` tools change nothing; `uncached` ones change nothing and
    always run (they read the sandbox into the trainer's own files)."""
    tools: dict[str, dict[str, bool]] = {name: {"mutates_state": False} for name in read_only}
    tools.update({name: {"mutates_state": False, "cacheable": False} for name in uncached})
    return tools


def plain(value: Any) -> Any:
    """`value` as JSON data: mappings, sequences, numbers and strings as they are, array-likes
    (numpy, OmegaConf containers) through their own conversion, anything else as its repr."""
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "tolist"):  # numpy arrays and scalars, as datasets hand them over
        return plain(value.tolist())
    if hasattr(value, "items"):
        return plain(dict(value.items()))
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


def json_only(value: Any, what: str) -> Any:
    """`value` as JSON data, or TypeError: a result served from the cache must be the one the
    tool gave, and an image or an object has no JSON form that would be."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"tvcache caches JSON results; {what} answered something else: {exc}") from exc


def digest(value: Any) -> str:
    """sha256 of `value`'s canonical JSON (sorted keys, no whitespace), as the service keys calls."""
    canonical = json.dumps(plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
