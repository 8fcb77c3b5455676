"""The test run's settings: the service's own, with a test-only secret key when none is set
(production settings refuse to start without one). Servers the tests start inherit it."""

import os
import tempfile

os.environ.setdefault("SECRET_KEY", "test-only-insecure-key")
# The run's metrics count in a folder of its own (servers the tests start share it), never in a
# running service's.
os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="tvcache-test-metrics-"))

from tvcache_site.settings import *  # noqa: E402,F403
