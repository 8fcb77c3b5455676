"""Workload replay: seeded agent rollouts driven through tvcache (client mode, tool-server mode)
and, side by side, without any cache; per-epoch hit rates, latencies, step times and an exactness
check of every hit against a fresh execution of the same history. The replay talks to the
service over its HTTP API only; a service it starts itself (lab.server) it also sets up and
cleans up (command.py).

    command.py   what the replay_* commands share: options, the service, the report and plots
    harness.py   arms, the epoch loop, measurements, the exactness check
    faults.py    the fault arm (--faults): seeded timeouts, errors, sandbox deaths, restarts
    report.py    the JSON report, the headline table, the targets
    plots.py     PNG plots (matplotlib)
    terminal.py  docker tasks in the spirit of terminal-bench
    sql.py       generated SQLite databases and query rollouts
    bfcl.py      BFCL multi-turn tasks (bfcl-eval) as tvclient environments
"""
