"""Websocket routes (the live dashboard pushes arrive here). Anonymous connections are refused
by the consumer; cross-site pages by the origin check."""

from channels.auth import AuthMiddlewareStack
from channels.routing import URLRouter
from channels.security.websocket import AllowedHostsOriginValidator
from django.urls import path

from . import access  # noqa: F401 (registers the taskkey converter)
from .consumers import DashboardConsumer

websocket_application = AllowedHostsOriginValidator(
    AuthMiddlewareStack(
        URLRouter(
            [
                path("ws/dashboard/overview/", DashboardConsumer.as_asgi(), {"topic": "overview"}),
                path("ws/dashboard/pools/", DashboardConsumer.as_asgi(), {"topic": "pools"}),
                path("ws/dashboard/tasks/<taskkey:task_id>/", DashboardConsumer.as_asgi(), {"topic": "task"}),
            ]
        )
    )
)
