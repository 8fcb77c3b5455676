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
.venv/bin/python manage.py shell -v 0 -c "from cache.models import ApiToken; ApiToken.objects.filter(name='demo').delete()"
# The demo puts its tasks again on every run (a rebuilt image changes their env): a maintainer.
TOKEN=$(.venv/bin/python manage.py create_token demo --project default --role maintainer)

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
DB_POOL_SIZE=16 .venv/bin/python -m uvicorn tvcache_site.asgi:application --host 127.0.0.1 --port 8000 --workers 2 \
  --log-level warning --no-access-log & pids+=($!)
if [ -n "${REDIS_URL:-}" ]; then
  .venv/bin/python -m celery -A tvcache_site worker -B -s var/celerybeat-schedule -Q tvcache --concurrency 2 -l warning & pids+=($!)
fi
for _ in $(seq 1 60); do curl -sf -o /dev/null http://127.0.0.1:8000/api/schema/ && break; sleep 0.5; done

cat <<MSG

  tvcache is serving on http://127.0.0.1:8000
    dashboard:  http://127.0.0.1:8000/        (log in as admin / tvcache-demo)
    API docs:   http://127.0.0.1:8000/api/docs/
    API token:  $TOKEN

MSG
.venv/bin/python manage.py demo_workload --url http://127.0.0.1:8000 --token "$TOKEN"
echo "demo workload done; the service keeps running (Ctrl-C to stop)"
wait "${pids[0]}"
