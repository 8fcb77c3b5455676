"""ASGI entry point (HTTP and websockets). Lookup, record and tool-server call POSTs are answered
before Django's handler and middleware, on threads of their own (cache/api/frontdoor.py, FrontDoorASGI)."""

import gc
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tvcache_site.settings")
django_asgi = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402  (needs Django set up)
from django.conf import settings  # noqa: E402

from cache.api.frontdoor import FrontDoorASGI  # noqa: E402
from cache.api.views import LookupView, RecordView  # noqa: E402
from dashboard.routing import websocket_application  # noqa: E402
from sandboxes.api import RolloutCallView  # noqa: E402
from workers.periodic import periodic_jobs_start  # noqa: E402

conf = settings.TVCACHE
http_application = FrontDoorASGI(
    django_asgi,
    [LookupView, RecordView, RolloutCallView],
    threads={
        "read": conf["HOT_PATH_THREADS"],
        "write": conf["RECORD_THREADS"],
        "tool": conf["TOOLSERVER_HIT_THREADS"],
        "exec": conf["TOOLSERVER_THREADS"],
        "auth": 1,
    },
    queue={
        "read": conf["LANE_QUEUE"],
        "write": conf["LANE_QUEUE"],
        "tool": conf["LANE_QUEUE"],
        "auth": conf["LANE_QUEUE"],
        "exec": conf["EXEC_QUEUE"],
    },
    waiters=conf["FLIGHT_WAITERS"],
)
application = ProtocolTypeRouter({"http": http_application, "websocket": websocket_application})
periodic_jobs_start()  # without Celery beat (no Redis), this process runs the periodic jobs

# What startup made (Django, the apps, their modules and settings) lives as long as the process:
# frozen out of the collector's passes, which otherwise walk all of it on every full collection
# (160 to 220 ms each under the hit benchmark: docs/design/hot-path.md, "The collector").
gc.freeze()
