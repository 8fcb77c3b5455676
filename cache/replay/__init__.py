"""Workload replay: seeded agent rollouts driven through tvcache (client mode, tool-server mode)
and, side by side, without any cache; per-epoch hit rates, latencies, step times and an exactness
check of every hit against a fresh execution of the same history.

    harness.py   arms, the epoch loop, measurements, the exactness check
    service.py   a live service (uvicorn + a Celery worker) in subprocesses
    report.py    the JSON report, the headline table, the targets
    plots.py     PNG plots (matplotlib)
    terminal.py  docker tasks in the spirit of terminal-bench
    sql.py       generated SQLite databases and query rollouts
    bfcl.py      BFCL multi-turn tasks (bfcl-eval) as tvclient environments
"""
