"""Upstreams: registration (registry), the verl-tool protocol (protocol), what a request item is
in the tool call graph (calls) and the caching proxy (proxy)."""

from .proxy import observations_serve
from .registry import proxy_path, upstream_by_secret, upstream_put

__all__ = ["observations_serve", "proxy_path", "upstream_by_secret", "upstream_put"]
