"""The sql workload: seeded shop databases and read-only query rollouts.

Each task is a database the harness generates (schema and rows from the seed). A rollout asks
6 to 10 queries: most from the task's pool of popular questions (Zipf-weighted, so rollouts
repeat each other), the rest freshly instantiated templates. A remote database is modelled by
`latency_ms` per executed query, charged the same everywhere a query really runs: the local
environment sleeps before each query (no-cache arm, client mode misses), and in tool-server mode
the harness sleeps after every call the service executed (the service's sqlite backend has no
latency of its own to configure). Hits pay nothing.
"""

from __future__ import annotations

import random
import shutil
import sqlite3
import tempfile
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from sandboxes.backends.config import SqliteConfig
from sandboxes.backends.sqlite import run_execute, run_query
from tvclient import ToolExecutionEnvironment

from .workload import Call, ReplayTask, Workload

SCHEMA_SQL = """
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL, tier TEXT NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL, price REAL NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
                     product_id INTEGER NOT NULL REFERENCES products(id), qty INTEGER NOT NULL, day INTEGER NOT NULL);
CREATE INDEX orders_customer ON orders(customer_id);
CREATE INDEX orders_day ON orders(day);
"""
CITIES = ["Lyon", "Oslo", "Porto", "Quito", "Kyoto", "Perth", "Tartu", "Cork"]
CATEGORIES = ["books", "garden", "kitchen", "toys", "tools", "music"]
TIERS = ["free", "silver", "gold"]
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "an", "or", "el"]

TEMPLATES = [
    "SELECT city, COUNT(*) AS n FROM customers WHERE tier = '{tier}' GROUP BY city ORDER BY n DESC, city",
    "SELECT name, price FROM products WHERE category = '{category}' ORDER BY price DESC, id LIMIT {k}",
    "SELECT c.name, ROUND(SUM(o.qty * p.price), 2) AS total FROM orders o JOIN customers c ON c.id = o.customer_id "
    "JOIN products p ON p.id = o.product_id WHERE c.city = '{city}' GROUP BY c.id ORDER BY total DESC, c.id LIMIT {k}",
    "SELECT day, COUNT(*) AS orders, SUM(qty) AS items FROM orders WHERE day BETWEEN {day} AND {day2} "
    "GROUP BY day ORDER BY day",
    "SELECT p.category, ROUND(AVG(o.qty), 3) AS avg_qty, COUNT(*) AS n FROM orders o JOIN products p "
    "ON p.id = o.product_id WHERE o.day >= {day} GROUP BY p.category ORDER BY p.category",
    "SELECT p.name, SUM(o.qty) AS sold FROM orders o JOIN products p ON p.id = o.product_id "
    "WHERE p.category = '{category}' GROUP BY p.id ORDER BY sold DESC, p.id LIMIT {k}",
    "SELECT c.tier, COUNT(DISTINCT o.customer_id) AS buyers FROM orders o JOIN customers c ON c.id = o.customer_id "
    "WHERE o.day BETWEEN {day} AND {day2} GROUP BY c.tier ORDER BY c.tier",
    "SELECT id, name, city FROM customers WHERE name LIKE '{prefix}%' ORDER BY id LIMIT {k}",
]
DAYS = 365


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def generate_database_sql(seed: int, *, customers: int, products: int, orders: int) -> str:
    """INSERT statements for one database; the same seed always gives the same rows."""
    rng = random.Random(seed)
    rows = [
        "INSERT INTO customers VALUES "
        + ",".join(
            f"({i},'{_name(rng)} {_name(rng)}','{rng.choice(CITIES)}','{rng.choice(TIERS)}')"
            for i in range(1, customers + 1)
        )
        + ";",
        "INSERT INTO products VALUES "
        + ",".join(
            f"({i},'{_name(rng)}','{rng.choice(CATEGORIES)}',{rng.randint(100, 9999) / 100})"
            for i in range(1, products + 1)
        )
        + ";",
        "INSERT INTO orders VALUES "
        + ",".join(
            f"({i},{rng.randint(1, customers)},{rng.randint(1, products)},{rng.randint(1, 5)},{rng.randint(1, DAYS)})"
            for i in range(1, orders + 1)
        )
        + ";",
    ]
    return "\n".join(rows)


def random_query(rng: random.Random) -> str:
    day = rng.randint(1, DAYS - 30)
    return rng.choice(TEMPLATES).format(
        tier=rng.choice(TIERS),
        category=rng.choice(CATEGORIES),
        city=rng.choice(CITIES),
        k=rng.choice([5, 10, 20]),
        day=day,
        day2=day + rng.choice([7, 14, 30]),
        prefix=rng.choice(SYLLABLES).capitalize(),
    )


class SqliteFileEnvironment(ToolExecutionEnvironment):
    """Client mode and no-cache arm: a copy of the task's database file per sandbox, with the
    sqlite backend's own `query`/`execute` implementations (same results as tool-server mode)."""

    backend = "sqlite-file"
    READ_ONLY = frozenset({"query"})

    def __init__(self, seed_db: Path, latency_ms: float, workdir: Path):
        self._seed_db = seed_db
        self._latency_s = latency_ms / 1000
        self._workdir = workdir
        self.path: Path | None = None
        self.size_bytes = 0

    def start(self) -> None:
        self.path = Path(tempfile.mkstemp(suffix=".sqlite", dir=self._workdir)[1])
        shutil.copyfile(self._seed_db, self.path)

    def execute(self, call: Call) -> dict[str, Any]:
        assert self.path is not None
        time.sleep(self._latency_s)
        run = run_query if call["tool"] == "query" else run_execute
        return run(self.path, call["args"]["sql"], SqliteConfig())

    def fork(self) -> SqliteFileEnvironment:
        assert self.path is not None
        twin = SqliteFileEnvironment(self.path, self._latency_s * 1000, self._workdir)
        twin.start()
        twin.size_bytes = twin.path.stat().st_size
        return twin

    def stop(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None

    def mutates_state(self, call: Call) -> bool:
        return call["tool"] not in self.READ_ONLY


class SqlWorkload(Workload):
    name = "sql"
    POPULAR = 12  # popular questions per task
    P_POPULAR = 0.7

    def __init__(self, *, tasks: int, rollouts: int, seed: int, latency_ms: float, rows: int = 1500):
        self.n_tasks = tasks
        self.n_rollouts = rollouts
        self.seed = seed
        self.latency_ms = latency_ms
        self.server_miss_penalty_ms = latency_ms
        self.rows = rows
        self._dir = Path(tempfile.mkdtemp(prefix="tvcache-replay-sql-"))
        self._tasks: list[ReplayTask] | None = None
        self._popular: dict[str, list[str]] = {}

    def describe(self) -> dict[str, Any]:
        return {
            "latency_ms": self.latency_ms,
            "rows_per_db": self.rows,
            "popular_queries": self.POPULAR,
            "p_popular": self.P_POPULAR,
        }

    def tasks(self) -> list[ReplayTask]:
        if self._tasks is None:
            self._tasks = [self._task(index) for index in range(self.n_tasks)]
        return self._tasks

    def _task(self, index: int) -> ReplayTask:
        name = f"shop{index}"
        seed_sql = generate_database_sql(
            self.seed * 7919 + index, customers=self.rows // 8, products=self.rows // 20, orders=self.rows
        )
        seed_db = self._dir / f"{name}.sqlite"
        with closing(sqlite3.connect(seed_db)) as conn:
            conn.executescript(SCHEMA_SQL)
            conn.executescript(seed_sql)
        rng = random.Random(f"{self.seed}-{name}-popular")
        self._popular[name] = [random_query(rng) for _ in range(self.POPULAR)]
        tools = {"query": {"mutates_state": False, "cacheable": True}}
        client_env = {
            "backend": "external",
            "workload": "sql",
            "schema_sql": SCHEMA_SQL,
            "seed_sql": seed_sql,
            "latency_ms": self.latency_ms,
        }
        server_env = {"backend": "sqlite", "schema_sql": SCHEMA_SQL, "seed_sql": seed_sql}

        def make_env() -> ToolExecutionEnvironment:
            return SqliteFileEnvironment(seed_db, self.latency_ms, self._dir)

        return ReplayTask(name, tools, client_env, server_env, make_env)

    def rollouts(self, task: ReplayTask, epoch: int) -> list[list[Call]]:
        popular = self._popular[task.name]
        weights = [1 / (rank + 1) for rank in range(len(popular))]
        out = []
        for index in range(self.n_rollouts):
            rng = random.Random(f"{self.seed}-{task.name}-{epoch}-{index}")
            calls = []
            for _ in range(rng.randint(6, 10)):
                if rng.random() < self.P_POPULAR:
                    sql = rng.choices(popular, weights)[0]
                else:
                    sql = random_query(rng)
                calls.append({"tool": "query", "args": {"sql": sql}})
            out.append(calls)
        return out

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
