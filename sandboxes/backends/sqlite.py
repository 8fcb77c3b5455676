"""The sqlite backend: a database file per sandbox.

`query` runs on a read-only connection, so it cannot change state whatever SQL it is given;
`execute` runs one statement in its own transaction (a connection per call: nothing is left
open between calls). Snapshots and forks use SQLite's online backup API.

Every connection caps one value or row (SQLITE_LIMIT_LENGTH), one statement's text and, when it
writes, the database's pages (max_page_count): a statement past a cap fails as SQLite fails it
("string or blob too big" is the agent's to see; a full database answers disk_quota_exceeded,
the statement rolled back). The caps are part of the env fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

from .base import (
    SOURCE_LABEL,
    DiskQuotaExceeded,
    InvalidEnv,
    LimitExceeded,
    OwnedResource,
    Sandbox,
    SandboxBackend,
    SandboxGone,
    SnapshotInfo,
    SnapshotMissing,
    ToolSpec,
    check_env_keys,
    check_labels,
    require_str,
)
from .config import SqliteConfig
from .folders import FolderStore
from .hostfs import StateDigest

# Bump when a tool's behaviour changes: it is part of the env fingerprint.
TOOLS_VERSION = 2
_DB = "db.sqlite"
_ENV_KEYS = frozenset({"backend", "schema_sql", "seed_sql"})
# Pragmas that would move files, change how the database file is written and read, or lift a cap.
_FORBIDDEN_PRAGMAS = frozenset(
    {
        "journal_mode",
        "locking_mode",
        "mmap_size",
        "temp_store_directory",
        "data_store_directory",
        "max_page_count",
        "page_size",
    }
)


class StatementTimeout(Exception):
    pass


def _authorize(action: int, arg1: str | None, arg2: str | None, _db: str | None, _trigger: str | None) -> int:
    # ATTACH (also behind VACUUM INTO) would read or write files anywhere on the host.
    if action in (sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH):
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_PRAGMA and arg1 in _FORBIDDEN_PRAGMAS and arg2 is not None:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


@contextmanager
def _connect(path: Path, config: SqliteConfig, *, read_only: bool, timeout_s: float) -> Iterator[sqlite3.Connection]:
    uri = path.resolve().as_uri() + ("?mode=ro" if read_only else "?mode=rw")
    with closing(sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)) as conn:
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, config.max_value_bytes)
        conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, config.max_sql_bytes)
        if read_only:
            conn.execute("PRAGMA query_only = ON")
        else:
            page_size = conn.execute("PRAGMA page_size").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count = {max(config.max_db_bytes // page_size, 1)}")
        conn.set_authorizer(_authorize)
        deadline = time.monotonic() + timeout_s
        conn.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
        try:
            yield conn
        except sqlite3.OperationalError as exc:
            if time.monotonic() > deadline:
                raise StatementTimeout(f"statement exceeded {timeout_s:g} s") from exc
            raise


def _is_full(exc: Exception) -> bool:
    # Errors Python raises itself (two statements at once) carry no SQLite code.
    return getattr(exc, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_FULL


def _jsonable(value: Any) -> Any:
    # BLOBs are returned as hex strings: results must be JSON.
    return value.hex() if isinstance(value, bytes) else value


def _error(result: dict[str, Any], exc: Exception) -> dict[str, Any]:
    return {**result, "error": str(exc), "timed_out": isinstance(exc, StatementTimeout)}


def run_query(db: Path, sql: str, config: SqliteConfig) -> dict[str, Any]:
    result: dict[str, Any] = {"columns": [], "rows": [], "truncated": False}
    try:
        with _connect(db, config, read_only=True, timeout_s=config.statement_timeout_s) as conn:
            cursor = conn.execute(sql)
            result["columns"] = [d[0] for d in cursor.description or ()]
            result["rows"], result["truncated"] = _capped_rows(cursor, config)
    except (sqlite3.Error, StatementTimeout) as exc:
        return _error(result, exc)
    return result


def _capped_rows(cursor: sqlite3.Cursor, config: SqliteConfig) -> tuple[list[list[Any]], bool]:
    rows: list[list[Any]] = []
    size = 0
    for raw in cursor:
        row = [_jsonable(v) for v in raw]
        size += len(json.dumps(row))
        if len(rows) == config.max_rows or size > config.max_result_bytes:
            return rows, True
        rows.append(row)
    return rows, False


def run_execute(db: Path, sql: str, config: SqliteConfig) -> dict[str, Any]:
    try:
        with _connect(db, config, read_only=False, timeout_s=config.statement_timeout_s) as conn:
            return {"rowcount": conn.execute(sql).rowcount}
    except sqlite3.Error as exc:
        if _is_full(exc):
            # The page cap, or the host's disk: not a result to cache. The statement was rolled back.
            raise DiskQuotaExceeded(
                f"the database is full: it may take {config.max_db_bytes} bytes",
                details={"max_bytes": config.max_db_bytes},
            ) from None
        return _error({"rowcount": None}, exc)
    except StatementTimeout as exc:
        return _error({"rowcount": None}, exc)


def _copy_db(source: Path, target: Path) -> None:
    """Online backup: consistent even while another connection writes the source."""
    with closing(sqlite3.connect(source.resolve().as_uri() + "?mode=ro", uri=True)) as src:
        with closing(sqlite3.connect(target)) as dst:
            try:
                src.backup(dst)
            except sqlite3.Error as exc:
                if _is_full(exc):
                    raise DiskQuotaExceeded(f"no space left for the sandbox's database: {exc}") from None
                raise


class SqliteSandbox(Sandbox):
    def __init__(self, backend: SqliteBackend, sandbox_id: str, folder: Path):
        self.sandbox_id = sandbox_id
        self._backend = backend
        self._folder = folder
        self._db = folder / _DB
        # A snapshot taken between two calls never sees half of one.
        self._lock = threading.Lock()

    def execute(self, tool: str, args: Mapping[str, Any]) -> dict[str, Any]:
        self._backend.tool_spec(tool)
        sql = require_str(args, "sql")
        run = run_query if tool == "query" else run_execute
        with self._lock:
            self._check_alive()
            return run(self._db, sql, self._backend.config)

    def state_fingerprint(self) -> StateDigest | None:
        """The database's logical content (its SQL dump): file pages differ between equal copies."""
        with self._lock:
            self._check_alive()
            digest = hashlib.sha256()
            with closing(sqlite3.connect(self._db.resolve().as_uri() + "?mode=ro", uri=True)) as connection:
                for line in connection.iterdump():
                    digest.update(line.encode("utf-8", "surrogatepass") + b"\n")
            return StateDigest(full=digest.hexdigest(), shape=digest.hexdigest())

    def snapshot(self, *, labels: Mapping[str, str] | None = None) -> SnapshotInfo:
        with self._lock:
            self._check_alive()
            started = time.perf_counter()
            snapshot_labels = {
                **self._backend.sandboxes.labels(self.sandbox_id),
                **check_labels(labels or {}),
                SOURCE_LABEL: self.sandbox_id,
            }
            ref = self._backend.snapshots.create(snapshot_labels, lambda staging: _copy_db(self._db, staging / _DB))
            create_ms = (time.perf_counter() - started) * 1000
        return SnapshotInfo(
            ref=ref, size_bytes=(self._backend.snapshots.root / ref / _DB).stat().st_size, create_ms=create_ms
        )

    def stop(self) -> None:
        self._backend.remove_sandbox(self.sandbox_id)

    def alive(self) -> bool:
        return self._db.is_file()

    def _check_alive(self) -> None:
        if not self.alive():
            raise SandboxGone(f"sqlite sandbox {self.sandbox_id} was removed")


class SqliteBackend(SandboxBackend):
    name = "sqlite"
    tools = {"query": ToolSpec(mutates_state=False), "execute": ToolSpec(mutates_state=True)}

    def __init__(self, root: Path, config: SqliteConfig = SqliteConfig()):
        self.config = config
        self.sandboxes = FolderStore(root / "sandboxes")
        self.snapshots = FolderStore(root / "snapshots")
        self._seeds = root / "seeds"
        self._seeds.mkdir(parents=True, exist_ok=True)

    def start(self, env: Mapping[str, Any], *, labels: Mapping[str, str]) -> SqliteSandbox:
        seed = self._seed(env)
        return self._open(self.sandboxes.create(check_labels(labels), lambda staging: _copy_db(seed, staging / _DB)))

    def fork(self, ref: str, env: Mapping[str, Any], *, labels: Mapping[str, str]) -> SqliteSandbox:
        source = self.snapshots.path(ref)
        if source is None:
            raise SnapshotMissing(f"no sqlite snapshot {ref!r}")
        return self._open(
            self.sandboxes.create(check_labels(labels), lambda staging: _copy_db(source / _DB, staging / _DB))
        )

    def delete_snapshot(self, ref: str) -> None:
        self.snapshots.remove(ref)

    def fingerprint_material(self, env: Mapping[str, Any]) -> dict[str, Any]:
        seed_hash = hashlib.sha256(self._seed(env).read_bytes()).hexdigest()
        caps = {
            "max_value_bytes": self.config.max_value_bytes,
            "max_sql_bytes": self.config.max_sql_bytes,
            "max_db_bytes": self.config.max_db_bytes,
        }
        return {
            "backend": self.name,
            "tools_version": TOOLS_VERSION,
            "sqlite_version": sqlite3.sqlite_version,
            "seed_sha256": seed_hash,
            "caps": caps,
        }

    def health(self) -> dict[str, Any]:
        return {
            "ok": os.access(self.sandboxes.root, os.W_OK) and os.access(self.snapshots.root, os.W_OK),
            "root": str(self._seeds.parent),
            "sqlite_version": sqlite3.sqlite_version,
            "sandboxes": self.sandboxes.count(),
            "snapshots": self.snapshots.count(),
        }

    def list_sandboxes(self, label_selector: Mapping[str, str] | None = None) -> list[OwnedResource]:
        return self.sandboxes.list(label_selector)

    def list_snapshots(self, label_selector: Mapping[str, str] | None = None) -> list[OwnedResource]:
        return self.snapshots.list(label_selector)

    def remove_sandbox(self, sandbox_id: str) -> None:
        self.sandboxes.remove(sandbox_id)

    def _seed(self, env: Mapping[str, Any]) -> Path:
        """The task's seed database, built once per distinct schema/seed SQL and then reused."""
        check_env_keys(env, _ENV_KEYS)
        scripts = [env.get("schema_sql") or "", env.get("seed_sql") or ""]
        if not all(isinstance(s, str) for s in scripts):
            raise InvalidEnv('"schema_sql" and "seed_sql" must be strings')
        key = hashlib.sha256(json.dumps(scripts).encode()).hexdigest()
        seed = self._seeds / f"{key}.sqlite"
        if not seed.exists():
            self._build_seed(seed, scripts)
        return seed

    def _build_seed(self, seed: Path, scripts: list[str]) -> None:
        staging = seed.with_name(f".staging-{os.getpid()}-{threading.get_ident()}-{seed.name}")
        staging.unlink(missing_ok=True)
        try:
            sqlite3.connect(staging).close()  # _connect opens existing files only (mode=rw)
            with _connect(staging, self.config, read_only=False, timeout_s=self.config.seed_timeout_s) as conn:
                for script in scripts:
                    # A script is many statements: the statement cap would count them as one.
                    length = len(script.encode("utf-8", "surrogatepass")) + 1
                    conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, max(length, self.config.max_sql_bytes))
                    conn.executescript(script)
        except (sqlite3.Error, StatementTimeout) as exc:
            staging.unlink(missing_ok=True)
            if _is_full(exc):
                raise LimitExceeded(
                    f"the seed database is larger than a sandbox's {self.config.max_db_bytes} bytes",
                    details={"limit": "max_db_bytes", "max": self.config.max_db_bytes},
                ) from None
            raise InvalidEnv(f"seeding the database failed: {exc}") from None
        os.replace(staging, seed)  # concurrent builders produce the same file; the last one wins

    def attach(self, sandbox_id: str) -> SqliteSandbox:
        if self.sandboxes.path(sandbox_id) is None:
            raise SandboxGone(f"sqlite sandbox {sandbox_id} does not exist")
        return self._open(sandbox_id)

    def _open(self, sandbox_id: str) -> SqliteSandbox:
        folder = self.sandboxes.path(sandbox_id)
        assert folder is not None  # just created
        return SqliteSandbox(self, sandbox_id, folder)
