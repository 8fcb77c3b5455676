"""The dashboard's websocket: joins the page's topic and forwards the live events that the ledger
sends (`cache.events`). A user gets the events of the projects they see (dashboard.access): staff
join the whole overview and pools groups, other users their projects' groups; a task's topic is
refused for another project's task."""

from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from accounts.projects import key_project
from cache import events

from . import access

GROUPS = {"overview": events.overview_group, "pools": events.pools_group}


class DashboardConsumer(AsyncWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close()  # before accept: the handshake is refused (HTTP 403)
            return
        kwargs = self.scope["url_route"]["kwargs"]
        topic = kwargs["topic"]
        mine = await database_sync_to_async(access.roles)(user)  # None: staff, every project
        if topic == "task":
            if mine is not None and key_project(kwargs["task_id"]) not in mine:
                await self.close()
                return
            self.topic_groups = [events.task_group(kwargs["task_id"])]
        else:
            group = GROUPS[topic]
            self.topic_groups = [group()] if mine is None else [group(project) for project in sorted(mine)]
        for group in self.topic_groups:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()

    async def disconnect(self, code):
        for group in getattr(self, "topic_groups", ()):
            await self.channel_layer.group_discard(group, self.channel_name)

    async def receive(self, text_data=None, bytes_data=None):
        pass  # the page only listens

    async def dashboard_push(self, event):
        await self.send(text_data=event["text"])
