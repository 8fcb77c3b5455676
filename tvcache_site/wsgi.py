"""WSGI entry point. Lookup, record and tool-server call POSTs are answered before Django's handler and middleware
(cache/api/lean.py, HotPathApplication); everything else is plain Django."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tvcache_site.settings")
django_application = get_wsgi_application()

from cache.api.lean import HotPathApplication  # noqa: E402  (needs the apps loaded)
from cache.api.views import LookupView, RecordView  # noqa: E402
from sandboxes.api import RolloutCallView  # noqa: E402
from workers.periodic import periodic_jobs_start  # noqa: E402

application = HotPathApplication(django_application, [LookupView, RecordView, RolloutCallView])
periodic_jobs_start()  # without Celery beat (no Redis), this process runs the periodic jobs
