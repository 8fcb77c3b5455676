"""PostgreSQL as the service uses it: Django's backend, but its pool checks a connection it hands
out without a round trip where the connection has been quiet.

Django's pool (psycopg_pool, `DB_POOL_SIZE`) checks every connection it hands out with an empty
statement when health checks are on, so that a connection PostgreSQL ended (a restart,
pg_terminate_backend) is replaced rather than failing its request. That is a round trip on every
checkout: each tool-server miss takes one (its lane gives its connection back while tools run),
about a tenth of what a miss adds to its call (docs/design/hot-path.md). A connection idle in the
pool is silent unless the server spoke to it unasked, and a server that ends a connection does so
(a FATAL error, then the socket's end): so a quiet socket is handed out as it is, and one with
anything to read, or closed, gets the full check (and is replaced if it fails)."""

from __future__ import annotations

import select

from django.db.backends.postgresql import base
from psycopg_pool import ConnectionPool


def check_unless_quiet(conn) -> None:
    """The pool's check: none for a connection with nothing to read, the round trip otherwise."""
    if not conn.closed:
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN | select.POLLPRI)
        if not poller.poll(0):
            return
    ConnectionPool.check_connection(conn)


class DatabaseWrapper(base.DatabaseWrapper):
    @property
    def pool(self):
        pool = super().pool
        # Django gives the pool psycopg's check when CONN_HEALTH_CHECKS is on; it takes no other.
        if pool is not None and pool._check is ConnectionPool.check_connection:
            pool._check = check_unless_quiet
        return pool
