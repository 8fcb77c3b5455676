"""The dashboard's websocket: joins the page's topic and forwards what `dashboard.broadcast` sends."""

from __future__ import annotations

from channels.generic.websocket import AsyncWebsocketConsumer

from . import broadcast

TOPICS = {"overview": broadcast.OVERVIEW_GROUP, "pools": broadcast.POOLS_GROUP}


class DashboardConsumer(AsyncWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close()  # before accept: the handshake is refused (HTTP 403)
            return
        kwargs = self.scope["url_route"]["kwargs"]
        topic = kwargs["topic"]
        self.topic_group = broadcast.task_group(kwargs["task_id"]) if topic == "task" else TOPICS[topic]
        await self.channel_layer.group_add(self.topic_group, self.channel_name)
        await self.accept()

    async def disconnect(self, code):
        group = getattr(self, "topic_group", None)
        if group is not None:
            await self.channel_layer.group_discard(group, self.channel_name)

    async def receive(self, text_data=None, bytes_data=None):
        pass  # the page only listens

    async def dashboard_push(self, event):
        await self.send(text_data=event["text"])
