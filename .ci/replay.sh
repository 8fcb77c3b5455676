#!/usr/bin/env bash
# Sets everything up and runs one workload replay: bash .ci/replay.sh terminal|sql|bfcl|video|tree [options]
# (the options of `manage.py replay_<workload>`, e.g. --tasks 4 --rollouts 8 --epochs 3; tree: the
# tree-search replay, `--workload terminal|sql` and the branching options of `manage.py replay_tree`).
set -euo pipefail
cd "$(dirname "$0")/.."
workload=${1:-}
case "$workload" in
  terminal|sql|bfcl|video|tree) shift ;;
  *) echo "usage: bash .ci/replay.sh terminal|sql|bfcl|video|tree [replay options]" >&2; exit 2 ;;
esac
docker_workload=false
[ "$workload" = terminal ] && docker_workload=true
if [ "$workload" = tree ]; then  # terminal unless --workload sql
  docker_workload=true
  [[ " $* " == *" --workload sql "* || " $* " == *" --workload=sql "* ]] && docker_workload=false
fi
[ "$docker_workload" = true ] && export TVCACHE_REQUIRE_DOCKER=1
source .ci/setup.sh
[ "$docker_workload" = true ] && .venv/bin/python manage.py build_images --only debian
exec .venv/bin/python manage.py "replay_$workload" "$@"
