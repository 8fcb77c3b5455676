"""The test run's settings: the service's own, with a test-only secret key when none is set
(production settings refuse to start without one). Servers the tests start inherit it."""

import os
import tempfile
from urllib.parse import urlsplit

os.environ.setdefault("SECRET_KEY", "test-only-insecure-key")
# The run's metrics count in a folder of its own (servers the tests start share it), never in a
# running service's.
os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="tvcache-test-metrics-"))
# Under pytest-xdist each worker is a run of its own beside the others: a Redis database of its
# own (Celery's queues, the channel layer's groups) and a metrics folder of its own, which the
# servers it starts inherit. Its database gets pytest-django's `_gw<N>` suffix, and its
# sandboxes are labelled with that database's name.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if WORKER:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix=f"tvcache-test-metrics-{WORKER}-")
    if os.environ.get("REDIS_URL"):
        redis = urlsplit(os.environ["REDIS_URL"])
        db = (int(redis.path.lstrip("/") or 0) + 1 + int(WORKER.removeprefix("gw"))) % 16
        os.environ["REDIS_URL"] = redis._replace(path=f"/{db}").geturl()

from tvcache_site.settings import *  # noqa: E402,F403

# Each test run has a database of its own (subprocesses inherit the name through the
# environment), so that runs side by side never drop each other's.
os.environ.setdefault("TVCACHE_TEST_RUN", str(os.getpid()))
DATABASES["default"].setdefault("TEST", {})["NAME"] = (  # noqa: F405
    f"test_{DATABASES['default']['NAME']}_{os.environ['TVCACHE_TEST_RUN']}"  # noqa: F405
)
