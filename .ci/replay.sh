#!/usr/bin/env bash
# Sets everything up and runs one workload replay: bash .ci/replay.sh terminal|sql|bfcl [options]
# (the options of `manage.py replay_<workload>`, e.g. --tasks 4 --rollouts 8 --epochs 3).
set -euo pipefail
cd "$(dirname "$0")/.."
workload=${1:-}
case "$workload" in
  terminal|sql|bfcl) shift ;;
  *) echo "usage: bash .ci/replay.sh terminal|sql|bfcl [replay options]" >&2; exit 2 ;;
esac
[ "$workload" = terminal ] && export TVCACHE_REQUIRE_DOCKER=1
source .ci/setup.sh
[ "$workload" = terminal ] && .venv/bin/python manage.py build_images --only debian
exec .venv/bin/python manage.py "replay_$workload" "$@"
