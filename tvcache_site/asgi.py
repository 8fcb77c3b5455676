"""ASGI entry point (HTTP and websockets). Lookup, record and tool-server call POSTs are answered
before Django's handler and middleware, on threads of their own (cache/api/lean.py, HotPathASGI)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tvcache_site.settings")
django_asgi = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402  (needs Django set up)
from django.conf import settings  # noqa: E402

from cache.api.lean import HotPathASGI  # noqa: E402
from cache.api.views import LookupView, RecordView  # noqa: E402
from dashboard.routing import websocket_application  # noqa: E402
from sandboxes.api import RolloutCallView  # noqa: E402

http_application = HotPathASGI(django_asgi, [LookupView, RecordView, RolloutCallView],
                               threads={"read": settings.TVCACHE["HOT_PATH_THREADS"],
                                        "write": settings.TVCACHE["RECORD_THREADS"],
                                        "tool": settings.TVCACHE["TOOLSERVER_THREADS"]})
application = ProtocolTypeRouter({"http": http_application, "websocket": websocket_application})
