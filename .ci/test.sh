#!/usr/bin/env bash
# Sets everything up and runs the whole test suite against real PostgreSQL, Redis, Docker and
# Chromium. A missing service fails the run; "no tests ran" (pytest exit 5) fails too.
set -euo pipefail
cd "$(dirname "$0")/.."
export TVCACHE_REQUIRE_DOCKER=1
source .ci/setup.sh
.venv/bin/python manage.py build_images
# The released frameworks the integrations are tested in, a venv each (built once per spec,
# cached outside the checkout: lab/frameworks/venvs.py).
.venv/bin/python -m lab.frameworks.venvs >/dev/null
.venv/bin/lint-imports
.venv/bin/ruff check --quiet . && .venv/bin/ruff format --check --quiet .
.venv/bin/python .ci/commits.py
status=0
# Three test processes side by side on two cores (TVCACHE_TEST_WORKERS): most of a test's time is
# spent waiting on containers, servers and browsers (the whole suite: 19 min with two, 15 with
# three, docs/contributing.md). Each is a run of its own (tests/settings.py).
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${TVCACHE_TEST_WORKERS:-3}" --dist loadfile "$@" || status=$?
[ "$status" = 5 ] && { echo "pytest collected no tests" >&2; exit 1; }
exit "$status"
