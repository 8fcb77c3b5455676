"""Open-loop HTTP load generator (run as its own process).

Requests are scheduled at a fixed rate whatever the server does; each request's latency runs from
its scheduled send time, so a slow server shows up as latency, not as a lower offered rate
(no coordinated omission). Raw asyncio streams with keep-alive: httpx would cost more CPU than
the server under test. Bounded by --duration; targets loopback only.

    python -m cache.bench.loadgen --url http://127.0.0.1:8000 --rate 1024 --duration 10 \
        --requests bodies.json --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from urllib.parse import urlsplit


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """Status code, and whether the server keeps the connection open."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length, keep_alive = 0, True
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
        elif name.lower() == b"connection" and value.strip().lower() == b"close":
            keep_alive = False
    if length:
        await reader.readexactly(length)
    return status, keep_alive


async def _worker(host, port, queue, results):
    """One connection at a time, reopened when the server closes it (sync WSGI workers do)."""
    connection = None
    try:
        while True:
            item = await queue.get()
            if item is None:
                return
            scheduled, kind, payload = item
            status, keep_alive = 599, False
            for _attempt in range(2):  # a kept-alive connection the server closed meanwhile: resend once
                if connection is None:
                    connection = await asyncio.open_connection(host, port)
                reader, writer = connection
                try:
                    writer.write(payload)
                    await writer.drain()
                    status, keep_alive = await _read_response(reader)
                    break
                except (asyncio.IncompleteReadError, ConnectionError):
                    writer.close()
                    connection = None
            results.append((kind, status, (time.perf_counter() - scheduled) * 1000.0))
            if not keep_alive:
                writer.close()
                connection = None
    finally:
        if connection is not None:
            connection[1].close()


async def run(url: str, rate: float, duration: float, requests: list[dict], token: str, connections: int) -> list:
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    encoded = []
    for request in requests:
        body = json.dumps(request["body"]).encode()
        head = (f"POST {request['path']} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Token {token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        encoded.append((request["kind"], head + body))
    queue: asyncio.Queue = asyncio.Queue()
    results: list = []
    workers = [asyncio.create_task(_worker(host, port, queue, results)) for _ in range(connections)]
    start = time.perf_counter()
    total = int(rate * duration)
    for index in range(total):
        scheduled = start + index / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        kind, payload = encoded[index % len(encoded)]
        queue.put_nowait((scheduled, kind, payload))
    for _ in workers:
        queue.put_nowait(None)
    await asyncio.wait_for(asyncio.gather(*workers), timeout=duration + 60)
    elapsed = time.perf_counter() - start
    return [results, elapsed]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--requests", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    with open(args.requests) as handle:
        requests = json.load(handle)
    results, elapsed = asyncio.run(run(args.url, args.rate, args.duration, requests, args.token, args.connections))
    with open(args.out, "w") as handle:
        json.dump({"elapsed_s": elapsed, "results": results}, handle)


if __name__ == "__main__":
    main()
