import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tvcache_site.settings")
django_asgi = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402  (needs Django set up)

from dashboard.routing import websocket_application  # noqa: E402

application = ProtocolTypeRouter({"http": django_asgi, "websocket": websocket_application})
