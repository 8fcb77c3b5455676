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
if [ ${#apt_packages[@]} -gt 0 ]; then
  log "installing Debian packages: ${apt_packages[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_packages[@]}" >/dev/null
fi

# The Docker engine: started when absent. TVCACHE_REQUIRE_DOCKER=1 (tests) makes failure fatal.
if ! docker info >/dev/null 2>&1; then
  log "starting dockerd"
  (dockerd >/tmp/tvcache-dockerd.log 2>&1 &)
  for _ in $(seq 1 30); do docker info >/dev/null 2>&1 && break; sleep 1; done
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
