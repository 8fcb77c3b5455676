"""The floor of saturated hits: a bare ASGI application that reads each request's body whole and
answers a fixed JSON body of a hit's size, served by the same uvicorn as tvcache
(`manage.py serve --web-only --app lab.bench.floor:application`). No framework, no token, no
lookup: what HTTP on this machine costs, which no lookup can beat (lab/bench/hits.py)."""

from __future__ import annotations

import json

# A hit answer's shape and size on the hits benchmark's workload (~290 bytes).
BODY = json.dumps(
    {"hit": True, "node_id": 1, "result": {"stdout": "prefix 0\n" + "x" * 200, "stderr": "", "exit_code": 0}},
    separators=(",", ":"),
).encode()
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]


async def application(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})
