"""What the state-keyed lookup adds to a miss's lookup statement (docs/design/state-match.md).

On the graphs a replay left in the database (its tool-server tasks: `--task-prefix`), takes misses
from states with a fingerprint (the call of another state's child, never recorded under this
one) and runs the lookup's statement for each, in turns with and without the state-keyed column,
on one prepared connection: P50 and P95 of each, of their difference, and of each miss's own
difference (the two runs of a miss are back to back). Writes state-probe.json
under --out.

    bash .ci/replay.sh terminal          # leaves its tasks in the database
    python -m lab.bench.state_probe --out artifacts/bench

Needs DATABASE_URL (the replay's database).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task-prefix", default="rp-", help="the tasks whose graphs are used (id prefix)")
    parser.add_argument("--misses", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="artifacts/bench")
    options = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tvcache_site.settings")
    import django

    django.setup()
    from django.db import connection

    from cache.prepared import prepared_cursor
    from cache.services import lookup

    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT p.task_id, t.version, encode(p.state_key, 'hex'),
                      (SELECT encode(m.call_digest, 'hex') FROM cache_node m
                       WHERE m.task_id = p.task_id AND m.anchor_key <> p.state_key ORDER BY m.id %% 97, m.id LIMIT 1)
               FROM cache_node p JOIN cache_task t ON t.id = p.task_id
               WHERE p.task_id LIKE %s AND p.mutates AND p.state_fingerprint <> '' AND t.env->>'backend' = 'docker'""",
            [options.task_prefix + "%"],
        )
        states = [row for row in cursor.fetchall() if row[3]]
    if not states:
        raise SystemExit(f"no state with a fingerprint in tasks {options.task_prefix}*: run a replay first")
    rng = random.Random(options.seed)
    without = lookup._READ_SQL.format(tainted="false", below="", probe="NULL")
    timings: dict[str, list[float]] = {"with": [], "without": []}
    for index in range(options.misses):
        task_id, version, anchor, digest = rng.choice(states)
        params = {
            "task": task_id,
            "version": version,
            "anchor": anchor,
            "digest": digest,
            "cacheable": True,
            "claim": False,
            "holder": "",
            "ttl": 1.0,
            "keys": anchor,
        }
        order = (("with", lookup.READ_SQL), ("without", without))
        for name, sql in order if index % 2 else order[::-1]:
            with prepared_cursor() as cursor:
                started = time.perf_counter()
                cursor.execute(sql, params)
                cursor.fetchone()
                timings[name].append((time.perf_counter() - started) * 1000)
    figures = {name: _quantiles(values) for name, values in timings.items()}
    figures["difference"] = {q: round(figures["with"][q] - figures["without"][q], 3) for q in ("p50", "p95")}
    # Each miss ran both ways back to back: the distribution of its own difference.
    figures["paired_difference"] = _quantiles([a - b for a, b in zip(timings["with"], timings["without"])])
    report = {
        "misses": options.misses,
        "states": len(states),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "ms": figures,
    }
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "state-probe.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": round(ordered[len(ordered) // 2], 3),
        "p95": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))], 3),
    }


if __name__ == "__main__":
    main()
