"""The audit log of staff actions on the cache (evictions, pins, flushes, budgets, sandbox stops),
and of what the service decides on its own (a tool the determinism audit made uncacheable)."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from cache.projects import MAX_TASK_KEY


class AuditEntry(models.Model):
    class Action(models.TextChoices):
        SUBTREE_EVICT = "subtree_evict", "Evict subtree"
        SNAPSHOT_EVICT = "snapshot_evict", "Evict snapshot"
        NODE_PIN = "node_pin", "Pin node"
        NODE_UNPIN = "node_unpin", "Unpin node"
        TASK_FLUSH = "task_flush", "Flush task"
        BUDGET_SET = "budget_set", "Set budget"
        SANDBOX_STOP = "sandbox_stop", "Stop sandbox"
        TOOL_UNCACHEABLE = "tool_uncacheable", "Tool made uncacheable (audit)"
        TASK_UPDATE = "task_update", "Change task (env, tools, budget)"

    class Outcome(models.TextChoices):
        OK = "ok"
        REFUSED = "refused"  # the service declined (unknown node, leased snapshot, bad budget...)
        FAILED = "failed"  # an unexpected error

    at = models.DateTimeField(default=timezone.now, db_index=True)
    # The name is kept apart from the foreign key so the log still says who after a user is deleted.
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="+")
    actor_name = models.CharField(max_length=150)  # a user's name, or "token:<name>" for an API token
    action = models.CharField(max_length=40, choices=Action.choices)
    # The task's key (cache.projects.task_key); no FK: the entry survives the task.
    task_id = models.CharField(max_length=MAX_TASK_KEY, blank=True, default="", db_index=True)
    # Whose log it is: members see their projects' entries.
    project = models.ForeignKey("cache.Project", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    target = models.CharField(max_length=300)
    outcome = models.CharField(max_length=10, choices=Outcome.choices)
    details = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor_name} {self.action} {self.target}: {self.outcome}"
