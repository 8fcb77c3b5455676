"""Workload replay: seeded agent rollouts driven through tvcache (client mode, tool-server mode)
and, side by side, without any cache; per-epoch hit rates, latencies, step times and an exactness
check of every hit against a fresh execution of the same history. The replay talks to the
service over its HTTP API only; a service it starts itself (lab.server) it also sets up and
cleans up (command.py).

    command.py   what the replay_* commands share: options, the service, the report and plots
    harness.py   Replay: the epoch loop over the parts below
    workload.py  the interface of a workload: its tasks and seeded rollouts
    arms.py      the arms (nocache, client, server, budgets) and their tasks on the service
    plans.py     what every arm issues: rollouts, step labels, each rollout's fault
    rollouts.py  how each arm runs a rollout, measured as samples (samples.py, metering.py)
    pacing.py    the policy's thinking before each call; the referee's paces
    exactness/   the exactness referee of the replays and the property tests
    stats.py     the service's own figures: per epoch, sandboxes, per tool, divergences
    faults.py    the fault arm (--faults): seeded timeouts, errors, sandbox deaths
    restarts.py  the fault arm's service restart, and the requests sent again
    report.py    the JSON report, the headline table, the targets
    plots.py     PNG plots (matplotlib)
    terminal.py  docker tasks in the spirit of terminal-bench
    sql.py       generated SQLite databases and query rollouts
    bfcl.py      BFCL multi-turn tasks (bfcl-eval) as tvclient environments
"""
