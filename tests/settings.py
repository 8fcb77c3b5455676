"""The test run's settings: the service's own, with a test-only secret key when none is set
(production settings refuse to start without one). Servers the tests start inherit it."""

import os
import tempfile

os.environ.setdefault("SECRET_KEY", "test-only-insecure-key")
# The run's metrics count in a folder of its own (servers the tests start share it), never in a
# running service's.
os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="tvcache-test-metrics-"))

from tvcache_site.settings import *  # noqa: E402,F403

# Each test run has a database of its own (subprocesses inherit the name through the
# environment), so that runs side by side never drop each other's.
os.environ.setdefault("TVCACHE_TEST_RUN", str(os.getpid()))
DATABASES["default"].setdefault("TEST", {})["NAME"] = (  # noqa: F405
    f"test_{DATABASES['default']['NAME']}_{os.environ['TVCACHE_TEST_RUN']}"  # noqa: F405
)
