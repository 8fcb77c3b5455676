"""Serves an httpx-style handler (request in, response out) on a loopback port, so the sync
client's tests go through its real transport and the async client's through httpx.MockTransport
with the same handler."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

Handler = Callable[[httpx.Request], httpx.Response]


@contextlib.contextmanager
def served(handler: Handler) -> Iterator[str]:
    """The base URL of a server answering every request with `handler`."""

    class Adapter(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the service answers

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            request = httpx.Request(
                self.command,
                f"http://{self.headers['Host']}{self.path}",
                headers=list(self.headers.items()),
                content=self.rfile.read(length),
            )
            try:
                response = handler(request)
            except Exception as exc:  # the test's own failure, shown in the client's error
                response = httpx.Response(500, text=f"handler raised {exc!r}")
            self.send_response(response.status_code)
            for name, value in response.headers.items():
                if name.lower() not in ("content-length", "transfer-encoding"):
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(response.content)))
            self.end_headers()
            self.wfile.write(response.content)

        do_GET = do_POST = do_PUT = do_DELETE = _answer

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Adapter)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
