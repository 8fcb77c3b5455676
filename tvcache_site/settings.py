"""Settings, all from the environment (django-environ).

PostgreSQL is always the store (DATABASE_URL, default the local server). Without REDIS_URL the
service falls back to embedded defaults (in-process background work, an in-memory channel
layer) and the run command says so at start. Tests and production set both.
"""

import os
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from observability.logs import logs_configure

BASE_DIR = Path(__file__).resolve().parent.parent
env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

DEBUG = env.bool("DEBUG", default=False)
# Sessions, CSRF tokens and signed values rest on it: without DEBUG the service refuses to start
# without one rather than fall back to a key anyone can read here.
SECRET_KEY = env("SECRET_KEY", default="")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured(
            "SECRET_KEY is not set. Set it in the environment (or in .env); with DEBUG=1 a "
            "development-only key is used instead."
        )
    SECRET_KEY = "dev-only-insecure-key-do-not-deploy"
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["127.0.0.1", "localhost", "testserver"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=["http://127.0.0.1:8000", "http://localhost:8000"])

VAR_DIR = Path(env("TVCACHE_VAR_DIR", default=str(BASE_DIR / "var")))

# PostgreSQL is the store of record, always (the hot paths use its SQL). The default is the
# local development server; production sets DATABASE_URL.
DATABASES = {"default": env.db("DATABASE_URL", default="postgres://postgres@127.0.0.1:5432/tvcache")}
DATABASES["default"]["ENGINE"] = "tvcache_site.postgresql"  # Django's, its pool's check cheaper (its docstring)
# Without a pool each thread keeps a persistent connection (Celery workers, commands). Under ASGI,
# sync views run on changing threads and persistent per-thread connections would pile up: set
# DB_POOL_SIZE to use a psycopg pool per process instead (the run command does).
# After a PostgreSQL restart every kept connection is dead: with health checks each is checked
# before a request uses it (under a pool, each one the pool hands out, with a round trip only if
# it has anything to read: tvcache_site/postgresql), so the service recovers by itself. A request
# whose connection died under it answers 503 database_unavailable.
if env.int("DB_POOL_SIZE", default=0):
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1,
        "max_size": env.int("DB_POOL_SIZE"),
        "timeout": 10,
    }
else:
    DATABASES["default"]["CONN_MAX_AGE"] = env.int("CONN_MAX_AGE", default=300)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env("REDIS_URL", default="")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's files, served from here (no CDN)
    "channels",
    "accounts",
    "cache",
    "sandboxes",
    "upstreams",
    "workers",
    "dashboard",
]
# The lab (replays, benchmarks, the demo workload: lab/) comes with a checkout, not with the
# service's wheel: its management commands are there when it is.
if (BASE_DIR / "lab" / "apps.py").is_file():
    INSTALLED_APPS.append("lab")

MIDDLEWARE = [
    "observability.logs.RequestIdMiddleware",  # first: every response carries X-Request-ID
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "tvcache_site.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "dashboard.context.background",
            ],
        },
    },
]
ASGI_APPLICATION = "tvcache_site.asgi.application"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STATICFILES_DIRS = [BASE_DIR / "dashboard" / "static"] if (BASE_DIR / "dashboard" / "static").exists() else []
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["accounts.api.auth.TrainerTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["core.api.rendering.ORJSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["core.api.rendering.ORJSONParser"],
    "EXCEPTION_HANDLER": "core.api.errors.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "tvcache API",
    "DESCRIPTION": "Stateful tool-value cache: lookups and records for RL rollouts.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # /api/docs/ works without internet: Swagger UI's files come from drf-spectacular-sidecar
    # (collectstatic, WhiteNoise), and no spec validator badge is fetched from validator.swagger.io.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "SWAGGER_UI_SETTINGS": {"deepLinking": True, "validatorUrl": None},
}

# Channels: Redis layer when Redis is configured, else in-memory (embedded mode only).
if REDIS_URL:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}}}
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# Celery
CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_RESULT_BACKEND = None
CELERY_TASK_ALWAYS_EAGER = not REDIS_URL
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = env("CELERY_QUEUE", default="tvcache")
# The periodic jobs: Celery beat's with Redis, else the service's own processes run them
# (workers/periodic.py, TVCACHE["PERIODIC_IN_PROCESS"]). Intervals in seconds.
CELERY_BEAT_SCHEDULE = {
    "reap-sandboxes-and-leases": {
        "task": "workers.tasks.sandboxes_reap",
        "schedule": env.float("TVCACHE_REAP_EVERY_S", default=15.0),
    },
    "evict-and-free-snapshots": {
        "task": "workers.tasks.snapshots_collect",
        "schedule": env.float("TVCACHE_COLLECT_EVERY_S", default=30.0),
    },
    "reap-orphans": {
        "task": "workers.tasks.orphans_reap",
        "schedule": env.float("TVCACHE_ORPHANS_EVERY_S", default=300.0),
    },
    "vacuum-tables": {"task": "workers.tasks.tables_vacuum", "schedule": 60.0},  # if autovacuum is off
    # Indexes that retention's deletes left sparse (cache/services/maintenance.py, indexes_rebuild).
    "rebuild-sparse-indexes": {
        "task": "workers.tasks.indexes_rebuild",
        "schedule": env.float("TVCACHE_REINDEX_EVERY_S", default=600.0),
    },
    "clear-lapsed-claims": {"task": "workers.tasks.claims_clear", "schedule": 60.0},
    "prune-request-counts": {"task": "workers.tasks.project_requests_prune", "schedule": 3600.0},
}

# tvcache limits and policy
TVCACHE = {
    "MAX_RESULT_BYTES": env.int("TVCACHE_MAX_RESULT_BYTES", default=1024 * 1024),
    "MAX_HISTORY": env.int("TVCACHE_MAX_HISTORY", default=10_000),
    # Levels of arrays and objects a call's args, a result or a task's env may nest (refused
    # deeper: 400 nesting_too_deep). At most 250: the JSON encoder stops at 254.
    "MAX_JSON_DEPTH": env.int("TVCACHE_MAX_JSON_DEPTH", default=64),
    "LEASE_TTL_S": env.float("TVCACHE_LEASE_TTL_S", default=600.0),
    "DEFAULT_SANDBOX_BUDGET": env.int("TVCACHE_DEFAULT_SANDBOX_BUDGET", default=64),
    # Lookup counters are written in batches this often by the ledger's thread (one per process,
    # which wakes every 0.3 s); 0 = only when stats are read (the tests use that: everything they
    # count is flushed before it is read).
    "COUNTER_FLUSH_S": env.float("TVCACHE_COUNTER_FLUSH_S", default=0.3),
    # Threads per ASGI process that answer lookups. One: more threads per process fight over the
    # GIL; run more processes instead (figures: docs/design/hot-path.md).
    "HOT_PATH_THREADS": env.int("TVCACHE_HOT_PATH_THREADS", default=1),
    # Threads per ASGI process that answer records, apart from lookups: a record mostly waits for
    # its commit to reach the disk, and a lookup queued behind it waited as long
    # (docs/design/hot-path.md).
    "RECORD_THREADS": env.int("TVCACHE_RECORD_THREADS", default=2),
    # Threads per ASGI process that run tool-server calls' tools (misses): the calls of this many
    # rollouts run at once (each holds a database connection while it runs: keep DB_POOL_SIZE above
    # it plus the other lanes' threads).
    "TOOLSERVER_THREADS": env.int("TVCACHE_TOOLSERVER_THREADS", default=12),
    # Threads per ASGI process that answer tool-server calls until they need a tool run: hits never
    # queue behind misses that run tools, nor behind rollouts waiting for another's run. Two: a
    # rollout's first call commits its row, and a hit queued behind that commit waited as long.
    "TOOLSERVER_HIT_THREADS": env.int("TVCACHE_TOOLSERVER_HIT_THREADS", default=2),
    # Bounded queues (ASGI): requests that may wait for a lane's threads beyond those running, per
    # process; one more answers 503 `overloaded` with Retry-After at once. EXEC_QUEUE is the
    # tool-run lane's (each waits for a tool run to end); FLIGHT_WAITERS counts the tool-server
    # calls waiting, on the event loop, for another rollout's run of the same call.
    "LANE_QUEUE": env.int("TVCACHE_LANE_QUEUE", default=256),
    "EXEC_QUEUE": env.int("TVCACHE_EXEC_QUEUE", default=64),
    "FLIGHT_WAITERS": env.int("TVCACHE_FLIGHT_WAITERS", default=1024),
    # Managed sandboxes (tool-server mode): where folders live, docker limits and start limiter.
    "SANDBOX_ROOT": env("TVCACHE_SANDBOX_ROOT", default=str(VAR_DIR / "sandboxes")),
    "DOCKER_URL": env("TVCACHE_DOCKER_URL", default=""),  # empty: DOCKER_HOST or the local socket
    # Several engines, comma-separated "URL=CAPACITY" (the sandboxes each is sized for), e.g.
    # "unix:///var/run/docker.sock=16,tcp://10.0.0.2:2376=8"; empty: the one engine above.
    # sandboxes/engines.py: placement by load, per-engine Celery queues.
    "DOCKER_ENGINES": env.list("TVCACHE_DOCKER_ENGINES", default=[]),
    "DOCKER_MAX_CONCURRENT_STARTS": env.int("TVCACHE_DOCKER_MAX_CONCURRENT_STARTS", default=2),
    "DOCKER_MEMORY_MB": env.int("TVCACHE_DOCKER_MEMORY_MB", default=512),
    "DOCKER_CPUS": env.float("TVCACHE_DOCKER_CPUS", default=1.0),
    "DOCKER_PIDS": env.int("TVCACHE_DOCKER_PIDS", default=256),
    # Containers are confined by these, whatever a task's env asks (a task above a maximum, naming
    # another image or asking for network without the grant is refused with a 403).
    "DOCKER_MAX_MEMORY_MB": env.int("TVCACHE_DOCKER_MAX_MEMORY_MB", default=4096),
    "DOCKER_MAX_CPUS": env.float("TVCACHE_DOCKER_MAX_CPUS", default=4.0),
    "DOCKER_MAX_PIDS": env.int("TVCACHE_DOCKER_MAX_PIDS", default=1024),
    # Images tasks may name (comma-separated); empty: the base images `manage.py build_images` builds.
    # Snapshot images (tvcache/snapshot:*) never, whatever the list says.
    "DOCKER_IMAGES": env.list("TVCACHE_DOCKER_IMAGES", default=[]),
    "DOCKER_ALLOW_NETWORK": env.bool("TVCACHE_DOCKER_ALLOW_NETWORK", default=False),
    # "uid[:gid]" sandboxes run as when their task names none; empty: the image's user (root). A
    # non-root user here is a floor: tasks may name another non-root user, never root.
    "DOCKER_USER": env("TVCACHE_DOCKER_USER", default=""),
    # ulimits of every sandbox process (0: not set). nproc counts a uid's processes host-wide.
    "DOCKER_ULIMIT_NOFILE": env.int("TVCACHE_DOCKER_ULIMIT_NOFILE", default=4096),
    "DOCKER_ULIMIT_NPROC": env.int("TVCACHE_DOCKER_ULIMIT_NPROC", default=0),
    "DOCKER_ULIMIT_FSIZE_MB": env.int("TVCACHE_DOCKER_ULIMIT_FSIZE_MB", default=0),  # 0: the disk quota
    # Disk quota of a sandbox's own layer (0: none): past it the sandbox is removed and its call
    # answers 413 disk_quota_exceeded. Measured on the host after calls and every DISK_CHECK_S.
    "DOCKER_DISK_MB": env.int("TVCACHE_DOCKER_DISK_MB", default=4096),
    "DOCKER_DISK_MAX_FILES": env.int("TVCACHE_DOCKER_DISK_MAX_FILES", default=500_000),
    "DOCKER_DISK_CHECK_S": env.float("TVCACHE_DOCKER_DISK_CHECK_S", default=2.0),
    # Folder sandboxes: their files together; sqlite sandboxes: one value or row, and the database.
    "DIRECTORY_MAX_MB": env.int("TVCACHE_DIRECTORY_MAX_MB", default=256),
    "SQLITE_MAX_VALUE_BYTES": env.int("TVCACHE_SQLITE_MAX_VALUE_BYTES", default=4 * 1024 * 1024),
    "SQLITE_MAX_DB_MB": env.int("TVCACHE_SQLITE_MAX_DB_MB", default=256),
    # A bash call that changed nothing in its container (read from the container's layer on the
    # host) counts as read-only in tool-server mode. Off: every bash call changes state.
    "DOCKER_OBSERVE_WRITES": env.bool("TVCACHE_DOCKER_OBSERVE_WRITES", default=True),
    # ... until the container's layer holds this many files (listing it costs ~10 us per file).
    "DOCKER_OBSERVE_MAX_ENTRIES": env.int("TVCACHE_DOCKER_OBSERVE_MAX_ENTRIES", default=20_000),
    # Bash calls run through one session agent per container (sandboxes/backends/docker/agent.py),
    # several times cheaper than a `docker exec` each (docs/results/bench/sandboxes-calls.md).
    "DOCKER_SESSION": env.bool("TVCACHE_DOCKER_SESSION", default=True),
    # The OCI runtime of docker sandboxes whose task names none, the runtimes a task may name
    # (`"runtime": "runsc"`), and those whose snapshots are checkpoints keeping processes and memory
    # (gVisor's runsc; runc only where CRIU works on the engine's kernel). runc stays the default:
    # gVisor is slower (docs/operations/runtimes.md).
    "DOCKER_RUNTIME": env("TVCACHE_DOCKER_RUNTIME", default="runc"),
    "DOCKER_RUNTIMES": env.list("TVCACHE_DOCKER_RUNTIMES", default=["runc", "runsc"]),
    "DOCKER_CHECKPOINT_RUNTIMES": env.list("TVCACHE_DOCKER_CHECKPOINT_RUNTIMES", default=["runsc"]),
    # Single flight (cache/services/flight.py), tool-server mode and the proxy: a rollout that misses on a call another rollout is executing in the same
    # state waits for that result at most this long, then executes it too.
    "SINGLE_FLIGHT_WAIT_S": env.float("TVCACHE_SINGLE_FLIGHT_WAIT_S", default=900.0),
    # Single flight, every mode: the rollout that claimed a call executes it while the others that
    # miss on it in the same state wait for its record; a claim neither recorded nor given up (the
    # trainer or the leading process died) lapses after this long and the next rollout executes.
    # A call that runs longer may be executed alongside it (twice, never wrongly).
    "CLAIM_TTL_S": env.float("TVCACHE_CLAIM_TTL_S", default=60.0),
    # Each process keeps the hits it served (cache/services/hitcache.py), at most this many (0: off)
    # and this many MB of results, and serves one again without a statement while a read of the
    # task's version sent less than the window ago says it has not moved. A change that moves a
    # task's version (env, tools, flush, a divergent node, an evicted subtree) waits the window
    # after its commit before it answers. Every process of a deployment must have the same values.
    "HIT_CACHE_ENTRIES": env.int("TVCACHE_HIT_CACHE_ENTRIES", default=16_384),
    "HIT_CACHE_MB": env.int("TVCACHE_HIT_CACHE_MB", default=64),
    "HIT_CACHE_WINDOW_MS": env.float("TVCACHE_HIT_CACHE_WINDOW_MS", default=50.0),
    # A tool-server rollout idle this long loses its sandbox (the reaper stops it).
    "ROLLOUT_IDLE_S": env.float("TVCACHE_ROLLOUT_IDLE_S", default=900.0),
    # Retention (tasks' max_nodes, max_result_bytes; docs/operations/retention.md): a node created
    # or hit this recently is on a live rollout's path and is never evicted, nor are its ancestors
    # (default: as long as an idle tool-server rollout keeps its sandbox). Each enforcement deletes
    # at most RETENTION_BATCH nodes per transaction.
    "RETENTION_LIVE_S": env.float(
        "TVCACHE_RETENTION_LIVE_S", default=env.float("TVCACHE_ROLLOUT_IDLE_S", default=900.0)
    ),
    "RETENTION_BATCH": env.int("TVCACHE_RETENTION_BATCH", default=5000),
    # The same job expires a rollout's history (its row, steps and kept calls) once it has ended or
    # keeps none of its own (client mode) and was neither started nor answered for this long; its
    # task's stats still count it. 0 keeps every rollout.
    "HISTORY_KEEP_S": env.float("TVCACHE_HISTORY_KEEP_S", default=7 * 86400.0),
    # Ready pre-forks kept per task (idle containers cost memory), and how long a ready sandbox
    # nobody takes stays up.
    "PREFORKS_PER_TASK": env.int("TVCACHE_PREFORKS_PER_TASK", default=4),
    "POOL_IDLE_S": env.float("TVCACHE_POOL_IDLE_S", default=600.0),
    # WARMING rows older than this belong to a worker that died: the reaper fails them.
    "WARMING_TIMEOUT_S": env.float("TVCACHE_WARMING_TIMEOUT_S", default=300.0),
    # A sandbox or snapshot labelled as ours that the database does not know is removed once it is
    # this old (a younger one may still be on its way into the database).
    "ORPHAN_GRACE_S": env.float("TVCACHE_ORPHAN_GRACE_S", default=120.0),
    # The periodic jobs (CELERY_BEAT_SCHEDULE) run in the service's processes: by default when there
    # is no Redis, hence no Celery beat (workers/periodic.py).
    "PERIODIC_IN_PROCESS": env.bool("TVCACHE_PERIODIC_IN_PROCESS", default=not REDIS_URL),
    # Determinism audit: the fraction of hits re-executed and compared, for a task that does not
    # set its own `audit_rate`; a tool with more than AUDIT_MAX_DIVERGENT divergent nodes in a
    # task becomes uncacheable for it.
    "DEFAULT_AUDIT_RATE": env.float("TVCACHE_DEFAULT_AUDIT_RATE", default=0.02),
    "AUDIT_MAX_DIVERGENT": env.int("TVCACHE_AUDIT_MAX_DIVERGENT", default=3),
    # How a new task that names no `match` matches (docs/design/state-match.md): "state" (also hits
    # from a state with the same verified fingerprint) or "history" (the longest-prefix rule only).
    "DEFAULT_MATCH": env.str("TVCACHE_DEFAULT_MATCH", default="state"),
    # State-keyed hits are sampled for the audit at least this often (and at least at the task's
    # `audit_rate`); a task with `audit_rate` 0 audits none.
    "STATE_AUDIT_RATE": env.float("TVCACHE_STATE_AUDIT_RATE", default=0.1),
    # Projects' rate limits are token buckets kept by each server process: set this to the number
    # of server processes (uvicorn --workers) and each admits its share of a project's rate.
    "RATE_LIMIT_PROCESSES": env.int("TVCACHE_RATE_LIMIT_PROCESSES", default=1),
}

if not 1 <= TVCACHE["MAX_JSON_DEPTH"] <= 250:
    raise ImproperlyConfigured("TVCACHE_MAX_JSON_DEPTH must be 1 to 250.")

# Metrics (/metrics, Prometheus text format): readable without a token from these addresses or
# networks only (REMOTE_ADDR: behind a proxy, list the proxy). Every process of the service counts
# into files under PROMETHEUS_MULTIPROC_DIR and a scrape adds them up (prometheus-client's
# multiprocess mode: uvicorn runs several workers, a Celery worker forks sandboxes); empty = one
# process, counts in memory. prometheus_client reads the variable when first imported: set here.
# The default is one folder per database: two services of one checkout on two databases (the
# demo and a replay) never add up each other's counts.
METRICS_ALLOW = env.list("TVCACHE_METRICS_ALLOW", default=["127.0.0.0/8", "::1"])
METRICS_DIR = env("PROMETHEUS_MULTIPROC_DIR", default=str(VAR_DIR / "metrics" / str(DATABASES["default"]["NAME"])))
if METRICS_DIR:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = METRICS_DIR
else:
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)

# Logs: JSON lines on stderr (structlog), each with the request id of the request that wrote it.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "observability.logs.json_formatter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "json"}},  # stderr
    "root": {"handlers": ["console"], "level": env("LOG_LEVEL", default="WARNING")},
    "loggers": {
        "tvcache": {"level": env("LOG_LEVEL", default="INFO")},
        # 4xx answers are the API working as documented, not server trouble worth a log line.
        "django.request": {"level": "ERROR"},
    },
}
logs_configure()  # structlog.get_logger() loggers and Python's warnings go through the same handler
