"""Websocket routes (the live dashboard pushes arrive here)."""

from channels.routing import URLRouter

websocket_application = URLRouter([])
