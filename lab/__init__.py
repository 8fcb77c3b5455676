"""The lab: code that measures and exercises tvcache from outside, never part of the service.

    server.py    the service as deployed, started and stopped in subprocesses (the tests use it too)
    browser.py   Debian's Chromium driven by Playwright against a served instance
    figures.py   the percentile every measurement here reports
    replay/      workload replays against a live service, over HTTP only
    bench/       the lookup load generator, the overload run, the sandbox measurements
    management/  manage.py bench_lookup, bench_sandboxes, bench_dashboard, demo_workload,
                 replay_terminal, replay_sql, replay_bfcl

A Django app of its own (for its commands), installed when the checkout has it: it is not in
the service's wheel, and no service package imports it (an import-linter contract).
"""
