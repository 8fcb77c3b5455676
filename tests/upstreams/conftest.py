"""A verl-tool-shaped upstream on loopback, and the service on a live server (real HTTP)."""

from __future__ import annotations

import pytest

from tests.support.upstreams import register

from .verl_tool_server import verl_tool_server


@pytest.fixture
def verl_tool():
    with verl_tool_server() as server:
        yield server


@pytest.fixture
def proxy(api, live_server):
    """Register an upstream; its proxy URL on the live server."""

    def make(name: str, **config) -> str:
        return live_server.url + register(api, name, **config)["proxy_path"]

    return make
