"""Database upkeep the hot paths depend on."""

from __future__ import annotations

import logging
import math

from django.apps import apps
from django.db import connection

log = logging.getLogger("tvcache.maintenance")


def claims_clear() -> int:
    """Delete lapsed claims (their holders never recorded); a lookup would take one over anyway."""
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM cache_claim WHERE expires_at < clock_timestamp()")
        return cursor.rowcount


def service_tables() -> list[str]:
    """Every table the service's models own. All of them, rather than a list of the busy ones: a
    list had to be kept up with every new counter table, and missed some (the graph's totals, whose
    128 rows took 73 MB after 2 million updates in the retention soak). VACUUM skips the pages
    nothing changed, so a quiet table costs little."""
    models = (m for m in apps.get_models() if m._meta.managed and not m._meta.proxy)
    return sorted({m._meta.db_table for m in models})


def tables_vacuum() -> list[str]:
    """VACUUM and ANALYZE the service's tables when autovacuum, which would, is off (as on this
    project's machines). With no statistics PostgreSQL takes every table for a tiny one and picks
    among indexes at random: the hit read went through the task's own index and filtered every
    node of the task, and the longest-prefix match scanned every live snapshot for each node.
    Without vacuum the dead rows of counter updates, claims and leases pile up in the heap and
    indexes the lookup reads (a day of replays here: 7,600 dead nodes, 7,400 dead claims for 236
    live ones). Needs autocommit: VACUUM cannot run in a transaction."""
    with connection.cursor() as cursor:
        cursor.execute("SHOW autovacuum")
        if cursor.fetchone()[0] == "on":
            return []
        tables = service_tables()
        cursor.execute("VACUUM (ANALYZE) " + ", ".join(connection.ops.quote_name(t) for t in tables))
    return tables


# The tables whose rows retention deletes all over their keys' order, old rows and new mixed
# (retention.py): a B-tree page is reused only once every entry on it is gone, so an index of
# ever-growing keys (ids) keeps the pages a few surviving rows hold and grows for as long as the
# churn lasts, while its table's heap holds (the retention soak: docs/operations/retention.md).
CHURNED_TABLES = ("cache_node", "cache_rolloutstep", "cache_rollout", "cache_rolloutcall")
# An index is rebuilt once it is this many times the size its entries need, and bigger by this much.
REBUILD_FACTOR = 2.5
REBUILD_MIN_EXCESS = 4 * 1024 * 1024
PAGE = 8192

# The churned tables' valid B-trees on plain columns (not expressions): name, bytes, entries (as the
# last VACUUM or ANALYZE counted them) and the entries' key width (the columns' average, ANALYZE's).
BTREES_SQL = """
SELECT ci.relname, pg_relation_size(i.indexrelid), ci.reltuples,
       (SELECT sum(coalesce(s.avg_width, 8)) FROM pg_attribute a
        LEFT JOIN pg_stats s ON s.schemaname = n.nspname AND s.tablename = ct.relname AND s.attname = a.attname
        WHERE a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey::int2[]))
FROM pg_index i
JOIN pg_class ci ON ci.oid = i.indexrelid
JOIN pg_am am ON am.oid = ci.relam
JOIN pg_class ct ON ct.oid = i.indrelid
JOIN pg_namespace n ON n.oid = ct.relnamespace
WHERE ct.relname = ANY(%s) AND n.nspname = current_schema() AND am.amname = 'btree' AND i.indisvalid
  AND NOT 0 = ANY(i.indkey::int2[]) AND ci.reltuples >= 0
ORDER BY ci.relname
"""

# What a rebuild that failed half way leaves: an invalid copy named <index>_ccnew (or _ccold).
LEFTOVERS_SQL = """
SELECT ci.relname FROM pg_index i
JOIN pg_class ci ON ci.oid = i.indexrelid JOIN pg_class ct ON ct.oid = i.indrelid
JOIN pg_namespace n ON n.oid = ct.relnamespace
WHERE ct.relname = ANY(%s) AND n.nspname = current_schema() AND NOT i.indisvalid
  AND ci.relname ~ '_cc(new|old)[0-9]*$'
"""


def btree_need(entries: float, key_width: float) -> int:
    """The bytes a freshly built B-tree of `entries` entries of `key_width` bytes of keys takes,
    about: leaf pages filled to the default 90 %, each entry a tuple header (8 bytes) and its keys
    aligned to 8, plus its line pointer (4). Deduplication makes an index smaller than this."""
    per_page = max(1, int((PAGE - 24 - 16) * 0.9) // (8 * math.ceil((8 + key_width) / 8) + 4))
    return (math.ceil(entries / per_page) + 1) * PAGE


def indexes_rebuild(*, factor: float = REBUILD_FACTOR, min_excess: int = REBUILD_MIN_EXCESS) -> list[str]:
    """Rebuild (REINDEX CONCURRENTLY: reads and writes go on) the churned tables' indexes that take
    `factor` times what their entries need, and `min_excess` bytes more; the names rebuilt. A
    rebuild that failed half way in an earlier run is cleaned up first. Needs autocommit. (Two runs
    at once would only rebuild an index twice: PostgreSQL lets one REINDEX CONCURRENTLY of an index
    run at a time.)"""
    rebuilt = []
    with connection.cursor() as cursor:
        cursor.execute(LEFTOVERS_SQL, [list(CHURNED_TABLES)])
        for (name,) in cursor.fetchall():
            cursor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {connection.ops.quote_name(name)}")
        cursor.execute(BTREES_SQL, [list(CHURNED_TABLES)])
        for name, size, entries, width in cursor.fetchall():
            need = btree_need(entries, float(width or 8))
            if size > factor * need and size - need > min_excess:
                cursor.execute(f"REINDEX INDEX CONCURRENTLY {connection.ops.quote_name(name)}")
                log.info("rebuilt index %s: %d bytes for %d entries (about %d needed)", name, size, entries, need)
                rebuilt.append(name)
    return rebuilt
