#!/usr/bin/env bash
# Sets everything up, serves tvcache on http://127.0.0.1:8000 (ASGI) and drives a demo workload
# through tvclient. Ctrl-C stops it all.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/setup.sh
[ "$TVCACHE_DOCKER" = 1 ] && .venv/bin/python manage.py build_images --only busybox
if ! redis-cli -u "$REDIS_URL" ping >/dev/null 2>&1; then
  log "no Redis at $REDIS_URL: background work runs in process (embedded default)"
  unset REDIS_URL
fi
.venv/bin/python manage.py shell -v 0 -c "
from django.contrib.auth import get_user_model
User = get_user_model()
if not User.objects.filter(username='admin').exists():
    User.objects.create_superuser('admin', 'admin@example.invalid', 'tvcache-demo')
"
# The demo puts its tasks again on every run (a rebuilt image changes their env): a maintainer.
TOKEN=$(.venv/bin/python manage.py create_token demo --project default --role maintainer --replace)

# `serve` runs uvicorn (and, with Redis, a Celery worker with beat) until it gets SIGTERM, then
# stops them and every sandbox the service started. Ctrl-C, SIGTERM or the end of this script
# stop it (and the workload); no container outlives the demo.
workload=
stop_all() {
  trap - EXIT INT TERM
  if [ -n "$workload" ]; then kill "$workload" 2>/dev/null || true; fi
  kill -TERM "$server" 2>/dev/null && wait "$server" || true
}
.venv/bin/python manage.py serve --port 8000 --workers 2 & server=$!
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for _ in $(seq 1 60); do curl -sf -o /dev/null http://127.0.0.1:8000/api/schema/ && break; sleep 0.5; done

cat <<MSG

  tvcache is serving on http://127.0.0.1:8000
    dashboard:  http://127.0.0.1:8000/        (log in as admin / tvcache-demo)
    API docs:   http://127.0.0.1:8000/api/docs/
    API token:  $TOKEN

MSG
# In the background: bash runs a trap between commands only, and SIGTERM must stop the demo at once.
.venv/bin/python manage.py demo_workload --url http://127.0.0.1:8000 --token "$TOKEN" & workload=$!
wait "$workload"
workload=
echo "demo workload done; the service keeps running (Ctrl-C to stop)"
wait "$server"
