"""The test run's settings: the service's own, with a test-only secret key when none is set
(production settings refuse to start without one). Servers the tests start inherit it."""

import os

os.environ.setdefault("SECRET_KEY", "test-only-insecure-key")

from tvcache_site.settings import *  # noqa: E402,F403
