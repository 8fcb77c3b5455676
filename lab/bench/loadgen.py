"""Open-loop HTTP load generator (run as its own process).

Requests are scheduled at a fixed rate whatever the server does; each request's latency runs from
its scheduled send time, so a slow server shows up as latency, not as a lower offered rate
(no coordinated omission). Bounded: nothing is sent after --duration, and requests still
unanswered --drain seconds later count as errors (status 599) with their latency at that moment.
Loopback only (the target must resolve to a loopback address).

It shares the machine with the server under test, so it is written to cost little CPU: requests
are encoded once up front; each connection is an asyncio Protocol (no stream objects) that
carries one request at a time (no pipelining), and a request that finds every connection busy
waits in a queue, its clock running. `--processes N` splits the schedule (request i goes to
process i mod N, all on one start time) when one process cannot keep up.

    python -m lab.bench.loadgen --url http://127.0.0.1:8000 --rate 1024 --duration 10 \
        --requests bodies.json --token KEY --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ipaddress
import json
import multiprocessing
import socket
import time
from urllib.parse import urlsplit

ABANDONED = 599  # no answer (connection failed twice, or still pending at the end of the drain)


def encode_requests(requests: list[dict], host: str, port: int, token: str) -> list[tuple[str, bytes]]:
    encoded = []
    for request in requests:
        body = json.dumps(request["body"]).encode()
        head = (
            f"POST {request['path']} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Token {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        encoded.append((request["kind"], head + body))
    return encoded


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses just enough HTTP/1.1 to find each response's end."""

    def __init__(self, pool: _Pool):
        self.pool = pool
        self.transport = None
        self.buffer = bytearray()
        self.request = None  # (scheduled, kind, payload, attempt)

    def connection_made(self, transport):
        self.transport = transport

    def send(self, request) -> None:
        self.request = request
        self.transport.write(request[2])

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buffer[:end]).lower()
        length, keep_alive = 0, True
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip() == b"close":
                keep_alive = False
        if len(self.buffer) < end + 4 + length:
            return
        status = int(head[9:12])
        del self.buffer[: end + 4 + length]
        request, self.request = self.request, None
        if not keep_alive:
            self.transport.close()
        self.pool.done(self, request, status, keep_alive)

    def connection_lost(self, exc) -> None:
        self.transport = None
        if self.pool.stopped:
            return
        if self.request is not None:  # a kept-alive connection the server closed meanwhile: resend once
            request, self.request = self.request, None
            self.pool.retry(self, request)
        else:
            self.pool.lost(self)


class _Pool:
    def __init__(self, loop, host: str, port: int, size: int, results: list):
        self.loop, self.host, self.port = loop, host, port
        self.idle: list[_Connection] = []
        self.open: set[_Connection] = set()
        self.closed = size  # connections not open (opened on demand)
        self.waiting: collections.deque = collections.deque()
        self.results = results
        self.pending = 0
        self.stopped = False  # after the cutoff: what still arrives or fails is not counted

    def submit(self, scheduled: float, kind: str, payload: bytes) -> None:
        self.pending += 1
        self._dispatch((scheduled, kind, payload, 0))

    def _dispatch(self, request) -> None:
        if self.idle:
            self.idle.pop().send(request)
        elif self.closed:
            self.closed -= 1
            self.loop.create_task(self._open(request))
        else:
            self.waiting.append(request)

    async def _open(self, request) -> None:
        try:
            _, connection = await self.loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except OSError:
            self.closed += 1
            self._finish(request, ABANDONED)
            return
        self.open.add(connection)
        connection.send(request)

    def done(self, connection: _Connection, request, status: int, keep_alive: bool) -> None:
        self._finish(request, status)
        if not keep_alive:
            return  # connection_lost returns the slot
        if self.waiting:
            connection.send(self.waiting.popleft())
        else:
            self.idle.append(connection)

    def retry(self, connection: _Connection, request) -> None:
        self.open.discard(connection)
        self.closed += 1
        if request[3] >= 1:
            self._finish(request, ABANDONED)
        else:
            self._dispatch((*request[:3], request[3] + 1))

    def lost(self, connection: _Connection) -> None:
        self.open.discard(connection)
        if connection in self.idle:
            self.idle.remove(connection)
        self.closed += 1
        if self.waiting:
            self._dispatch(self.waiting.popleft())

    def _finish(self, request, status: int) -> None:
        self.pending -= 1
        self.results.append((request[1], status, (time.monotonic() - request[0]) * 1000.0))
        if self.waiting and self.closed:  # a failed open freed a slot
            self._dispatch(self.waiting.popleft())


async def run(
    host: str,
    port: int,
    rate: float,
    duration: float,
    encoded: list,
    connections: int,
    start: float,
    shard: int = 0,
    shards: int = 1,
    drain: float = 30.0,
) -> tuple[list, float]:
    loop = asyncio.get_running_loop()
    results: list = []
    pool = _Pool(loop, host, port, connections, results)
    total = int(rate * duration)
    index = shard
    while index < total:
        now = time.monotonic()
        while index < total and start + index / rate <= now:  # everything due, even if the loop was late
            kind, payload = encoded[index % len(encoded)]
            pool.submit(start + index / rate, kind, payload)
            index += shards
        if index < total:
            await asyncio.sleep(max(0.0, start + index / rate - time.monotonic()))
    deadline = time.monotonic() + drain
    while pool.pending and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    cutoff = time.monotonic()
    pool.stopped = True
    unanswered = [c.request for c in pool.open if c.request is not None] + list(pool.waiting)
    for scheduled, kind, _, _ in unanswered:  # errors, with their latency at the cutoff
        results.append((kind, ABANDONED, (cutoff - scheduled) * 1000.0))
    for connection in pool.open:
        if connection.transport is not None:
            connection.transport.close()
    return results, cutoff


def _loopback(host: str) -> None:
    address = ipaddress.ip_address(socket.gethostbyname(host))
    if not address.is_loopback:
        raise SystemExit(f"{host} is not a loopback address: this load generator only targets this machine")


def _shard(args, shard: int, start: float, queue) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    with open(args.requests) as handle:
        encoded = encode_requests(json.load(handle), args.host, args.port, args.token)
    results, finished = asyncio.run(
        run(
            args.host,
            args.port,
            args.rate,
            args.duration,
            encoded,
            max(1, args.connections // args.processes),
            start,
            shard,
            args.processes,
            args.drain,
        )
    )
    queue.put((results, finished))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--requests", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--drain", type=float, default=30.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    parts = urlsplit(args.url)
    args.host, args.port = parts.hostname, parts.port or 80
    _loopback(args.host)
    start = time.monotonic() + 0.5  # every shard is up and has encoded its requests by then
    queue = multiprocessing.get_context("fork").Queue()
    workers = [
        multiprocessing.get_context("fork").Process(target=_shard, args=(args, shard, start, queue))
        for shard in range(args.processes)
    ]
    for worker in workers:
        worker.start()
    shards = [queue.get() for _ in workers]
    for worker in workers:
        worker.join()
    results = [row for rows, _ in shards for row in rows]
    elapsed = max(finished for _, finished in shards) - start
    with open(args.out, "w") as handle:
        json.dump({"elapsed_s": elapsed, "results": results}, handle)


if __name__ == "__main__":
    main()
