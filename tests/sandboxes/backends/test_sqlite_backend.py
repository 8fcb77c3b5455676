"""The sqlite backend: read-only queries, capped results, timeouts, snapshots by online backup."""

from __future__ import annotations

import pytest

from sandboxes.backends.base import (
    DiskQuotaExceeded,
    InvalidEnv,
    InvalidToolArgs,
    LimitExceeded,
    SandboxGone,
    SnapshotMissing,
    ToolNotFound,
)
from sandboxes.backends.config import SqliteConfig
from sandboxes.backends.sqlite import SqliteBackend

ENV = {
    "backend": "sqlite",
    "schema_sql": "CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT, avatar BLOB);",
    "seed_sql": "INSERT INTO users (name, avatar) VALUES ('ada', x'cafe'), ('bob', NULL), ('cy', NULL);",
}
COUNT = "SELECT count(*) FROM users"
ENDLESS = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT max(i) FROM n"


@pytest.fixture
def sandbox(sqlite_backend):
    return sqlite_backend.start(ENV, labels={"tvcache.task": "t1"})


def query(sandbox, sql):
    return sandbox.execute("query", {"sql": sql})


def execute(sandbox, sql):
    return sandbox.execute("execute", {"sql": sql})


def test_query_returns_columns_and_rows(sandbox):
    result = query(sandbox, "SELECT id, name, avatar FROM users ORDER BY id")
    assert result == {
        "columns": ["id", "name", "avatar"],
        "rows": [[1, "ada", "cafe"], [2, "bob", None], [3, "cy", None]],
        "truncated": False,
    }


def test_execute_changes_the_database_and_reports_rowcount(sandbox):
    assert execute(sandbox, "UPDATE users SET name = upper(name) WHERE id < 3") == {"rowcount": 2}
    assert query(sandbox, "SELECT name FROM users WHERE id = 1")["rows"] == [["ADA"]]


def test_query_refuses_writes(sandbox):
    for sql in [
        "DELETE FROM users",
        "INSERT INTO users (name) VALUES ('eve')",
        "DROP TABLE users",
        "PRAGMA user_version = 3",
    ]:
        result = query(sandbox, sql)
        assert "readonly" in result["error"] or "read-only" in result["error"], sql
    assert query(sandbox, COUNT)["rows"] == [[3]]
    assert query(sandbox, "PRAGMA user_version")["rows"] == [[0]]


def test_sql_errors_are_results(sandbox):
    assert "no such table" in query(sandbox, "SELECT * FROM nope")["error"]
    assert execute(sandbox, "INSERT INTO nope VALUES (1)")["rowcount"] is None


def test_files_outside_the_database_are_out_of_reach(sandbox, tmp_path):
    target = tmp_path / "stolen.db"
    assert "error" in execute(sandbox, f"ATTACH DATABASE '{target}' AS stolen")
    assert "error" in execute(sandbox, f"VACUUM INTO '{target}'")
    assert not target.exists()


def test_a_slow_statement_times_out(tmp_path):
    backend = SqliteBackend(tmp_path, SqliteConfig(statement_timeout_s=0.2))
    sandbox = backend.start(ENV, labels={})
    for result in (query(sandbox, ENDLESS), execute(sandbox, f"INSERT INTO users (name) {ENDLESS}")):
        assert result["timed_out"] is True and "exceeded" in result["error"]
    assert query(sandbox, COUNT)["rows"] == [[3]]


def test_results_are_capped_by_rows_and_by_bytes(tmp_path):
    backend = SqliteBackend(tmp_path, SqliteConfig(max_rows=2, max_result_bytes=40))
    sandbox = backend.start(ENV, labels={})
    by_rows = query(sandbox, "SELECT id FROM users")
    assert by_rows == {"columns": ["id"], "rows": [[1], [2]], "truncated": True}
    by_bytes = query(sandbox, "SELECT printf('%030d', id) FROM users")
    assert len(by_bytes["rows"]) == 1 and by_bytes["truncated"] is True


def test_snapshot_and_fork_are_independent(sqlite_backend, sandbox):
    snap = sandbox.snapshot()
    assert snap.size_bytes > 0
    fork = sqlite_backend.fork(snap.ref, ENV, labels={})
    execute(fork, "DELETE FROM users")
    execute(sandbox, "INSERT INTO users (name) VALUES ('dee')")
    assert query(fork, COUNT)["rows"] == [[0]]
    assert query(sandbox, COUNT)["rows"] == [[4]]
    assert query(sqlite_backend.fork(snap.ref, ENV, labels={}), COUNT)["rows"] == [[3]]


def test_seed_is_part_of_the_fingerprint(sqlite_backend):
    material = sqlite_backend.fingerprint_material(ENV)
    assert material["seed_sha256"] == sqlite_backend.fingerprint_material(dict(ENV))["seed_sha256"]
    other = sqlite_backend.fingerprint_material({**ENV, "seed_sql": "INSERT INTO users (name) VALUES ('zed');"})
    assert other["seed_sha256"] != material["seed_sha256"]
    assert material["sqlite_version"]


def test_bad_specs_are_refused(sqlite_backend):
    with pytest.raises(InvalidEnv):
        sqlite_backend.start({"backend": "sqlite", "schema_sql": "CREATE TABL oops"}, labels={})
    with pytest.raises(InvalidEnv):
        sqlite_backend.start({"backend": "sqlite", "seed": "x"}, labels={})


def test_listing_removal_and_missing_snapshots(sqlite_backend, sandbox):
    snap = sandbox.snapshot(labels={"tvcache.node": "9"})
    assert [s.id for s in sqlite_backend.list_sandboxes({"tvcache.task": "t1"})] == [sandbox.sandbox_id]
    assert [s.id for s in sqlite_backend.list_snapshots({"tvcache.node": "9"})] == [snap.ref]
    sqlite_backend.remove_sandbox(sandbox.sandbox_id)
    assert not sandbox.alive()
    with pytest.raises(SandboxGone):
        query(sandbox, COUNT)
    sqlite_backend.delete_snapshot(snap.ref)
    with pytest.raises(SnapshotMissing):
        sqlite_backend.fork(snap.ref, ENV, labels={})


def test_unknown_tool_and_bad_args(sandbox):
    with pytest.raises(ToolNotFound):
        sandbox.execute("read_file", {"path": "x"})
    with pytest.raises(InvalidToolArgs):
        sandbox.execute("query", {"statement": "SELECT 1"})


def test_values_and_rows_past_the_cap_fail_as_sqlite_fails_them(tmp_path):
    sandbox = SqliteBackend(tmp_path, SqliteConfig(max_value_bytes=100_000)).start(ENV, labels={})
    # Without the cap, a query could make SQLite build a value as large as memory allows.
    assert "too big" in query(sandbox, "SELECT randomblob(200000)")["error"]
    assert "too big" in execute(sandbox, "INSERT INTO users (name, avatar) VALUES ('eve', zeroblob(200000))")["error"]
    assert execute(sandbox, "INSERT INTO users (name, avatar) VALUES ('eve', zeroblob(50000))")["rowcount"] == 1
    assert "too" in execute(sandbox, "SELECT '" + "x" * 2_000_000 + "'")["error"]  # the statement's own text


def test_a_database_past_its_pages_is_refused_and_rolled_back(tmp_path):
    backend = SqliteBackend(tmp_path, SqliteConfig(max_db_bytes=64 * 1024))
    sandbox = backend.start(ENV, labels={})
    grow = "INSERT INTO users (name, avatar) SELECT 'x', randomblob(10000) FROM users"
    execute(sandbox, grow)
    before = query(sandbox, COUNT)["rows"]
    with pytest.raises(DiskQuotaExceeded) as full:
        for _ in range(10):
            execute(sandbox, grow)
    assert full.value.code == "disk_quota_exceeded"
    after = query(sandbox, COUNT)["rows"]
    assert after[0][0] < 64 and query(sandbox, COUNT)["rows"] == after  # the failing statement left nothing
    assert before[0][0] <= after[0][0]
    # The cap is the service's: a statement cannot lift it.
    assert "not authorized" in execute(sandbox, "PRAGMA max_page_count = 1000000")["error"]
    with pytest.raises(LimitExceeded):
        backend.start({**ENV, "seed_sql": "INSERT INTO users (avatar) VALUES (randomblob(100000))"}, labels={})


def test_the_caps_are_part_of_the_fingerprint(tmp_path):
    small = SqliteBackend(tmp_path / "a", SqliteConfig(max_db_bytes=64 * 1024)).fingerprint_material(ENV)
    large = SqliteBackend(tmp_path / "b", SqliteConfig()).fingerprint_material(ENV)
    assert small["seed_sha256"] == large["seed_sha256"] and small != large


def test_the_state_fingerprint_follows_the_rows_across_forks(sqlite_backend):
    env = {"backend": "sqlite", "schema_sql": "CREATE TABLE t (x INTEGER)"}
    sandbox = sqlite_backend.start(env, labels={})
    sandbox.execute("execute", {"sql": "INSERT INTO t VALUES (1)"})
    expected = sandbox.state_fingerprint()
    fork = sqlite_backend.fork(sandbox.snapshot().ref, env, labels={})
    assert fork.state_fingerprint() == expected
    fork.execute("execute", {"sql": "INSERT INTO t VALUES (2)"})
    assert fork.state_fingerprint() != expected
