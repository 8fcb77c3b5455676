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
.venv/bin/python -m pytest -q -p no:cacheprovider "$@" || status=$?
[ "$status" = 5 ] && { echo "pytest collected no tests" >&2; exit 1; }
exit "$status"
