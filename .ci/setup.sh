#!/usr/bin/env bash
# Sets up everything tvcache needs on a fresh Debian machine of this kind; safe to rerun.
# Sourced by .ci/demo.sh and .ci/test.sh. Exports DATABASE_URL, REDIS_URL and SECRET_KEY for them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/tvcache}
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
log() { echo "[setup] $*"; }

apt_packages=()
command -v dockerd >/dev/null || apt_packages+=(docker.io)
command -v chromium >/dev/null || apt_packages+=(chromium chromium-driver)
command -v busybox >/dev/null || apt_packages+=(busybox-static)
command -v debootstrap >/dev/null || apt_packages+=(debootstrap)
command -v runsc >/dev/null || apt_packages+=(runsc)  # gVisor: sandboxes whose snapshots keep processes
if [ ${#apt_packages[@]} -gt 0 ]; then
  log "installing Debian packages: ${apt_packages[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_packages[@]}" >/dev/null
fi

# The Docker engine: started when absent. TVCACHE_REQUIRE_DOCKER=1 (tests) makes failure fatal.
# It runs sandboxes under runc (the default) and gVisor's runsc (a task's "runtime": "runsc"),
# whose checkpoints are an experimental API of Docker's (docs/operations/runtimes.md). The
# configuration is a file of tvcache's own: a dockerd started elsewhere (the tests' second engine)
# keeps Docker's defaults.
docker_config=${TVCACHE_DOCKERD_CONFIG:-/etc/tvcache/dockerd.json}
engine_up() { for _ in $(seq 1 30); do docker info >/dev/null 2>&1 && return 0; sleep 1; done; return 1; }
engine_has_runsc() {  # the checkpoint API exists only on a dockerd started experimental
  [[ "$(docker info --format '{{json .Runtimes}}' 2>/dev/null)" == *'"runsc"'* ]] \
    && [[ "$(docker checkpoint ls tvcache-no-such-container 2>&1)" == *"No such container"* ]]
}
mkdir -p "$(dirname "$docker_config")"
python3 - "$docker_config" <<'PY'
import json, os, sys
path = sys.argv[1]
config = json.load(open(path)) if os.path.exists(path) and os.path.getsize(path) else {}
# live-restore: running containers outlive a restart of the engine.
wanted = {**config, "experimental": True, "live-restore": True,
          "runtimes": {**config.get("runtimes", {}),
                       # no network of its own: runsc refuses one in a VM's root namespace
                       "runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none"]}}}
if wanted != config:
    with open(path + ".tmp", "w") as f:
        json.dump(wanted, f, indent=2)
    os.replace(path + ".tmp", path)
PY
if ! docker info >/dev/null 2>&1; then
  log "starting dockerd"
  (dockerd --config-file "$docker_config" >/tmp/tvcache-dockerd.log 2>&1 &)
  engine_up || true
elif ! engine_has_runsc; then
  # A dockerd started without that configuration is restarted with it, unless containers would
  # die with it (they outlive it only under live-restore): then it is left as it is.
  dockerd_pid=$(cat /var/run/docker.pid 2>/dev/null || true)
  running=$(docker ps -q | wc -l)
  if [ -n "$dockerd_pid" ] && { [ "$running" = 0 ] || [ "$(docker info --format '{{.LiveRestoreEnabled}}')" = true ]; }; then
    if command -v systemctl >/dev/null && systemctl is-active --quiet docker 2>/dev/null; then
      log "docker.service runs without runsc: add $docker_config to /etc/docker/daemon.json and restart it"
    else
      log "restarting dockerd ($dockerd_pid) with $docker_config"
      kill -TERM "$dockerd_pid"
      for _ in $(seq 1 60); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.5; done
      (dockerd --config-file "$docker_config" >>/tmp/tvcache-dockerd.log 2>&1 &)
      engine_up || true
      for _ in $(seq 1 30); do engine_has_runsc && break; sleep 1; done
    fi
  fi
  engine_has_runsc || log "dockerd runs without runsc and $running containers would die with a restart: restart it" \
    "with --config-file $docker_config when they are done (docs/operations/runtimes.md)"
fi
if docker info >/dev/null 2>&1; then
  export TVCACHE_DOCKER=1
else
  export TVCACHE_DOCKER=0
  log "no Docker engine: docker sandboxes are unavailable (see /tmp/tvcache-dockerd.log)"
  [ "${TVCACHE_REQUIRE_DOCKER:-0}" = 1 ] && { echo "Docker engine required" >&2; exit 1; }
fi

if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check -e ".[test,bench,docs]" -e ./tvclient 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import bfcl_eval" 2>/dev/null \
  || .venv/bin/pip install -q --disable-pip-version-check --no-deps "bfcl-eval>=2025.1" 2>&1 | grep -v "^WARNING: Location" || true

# Production settings refuse to start without SECRET_KEY: one per checkout, kept outside git.
if [ -z "${SECRET_KEY:-}" ]; then
  mkdir -p var
  [ -s var/secret_key ] || (umask 077 && .venv/bin/python -c "import secrets; print(secrets.token_urlsafe(50))" > var/secret_key)
  SECRET_KEY=$(cat var/secret_key)
  export SECRET_KEY
fi

# PostgreSQL: create the database if it is missing.
db_name=$(.venv/bin/python -c "import os,urllib.parse as u; print(u.urlparse(os.environ['DATABASE_URL']).path.lstrip('/'))")
if ! psql "$DATABASE_URL" -c "select 1" >/dev/null 2>&1; then
  log "creating database $db_name"
  psql "${DATABASE_URL%/*}/postgres" -c "create database \"$db_name\"" >/dev/null
fi
.venv/bin/python manage.py migrate --noinput -v 0
.venv/bin/python manage.py collectstatic --noinput -v 0
