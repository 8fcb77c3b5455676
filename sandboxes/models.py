"""Sandboxes the service manages (tool-server mode, pools, pre-forks)."""

from __future__ import annotations

from django.db import models
from django.db.models import Q


class Sandbox(models.Model):
    class State(models.TextChoices):
        WARMING = "warming"  # row exists, a worker is starting or forking it
        READY = "ready"  # running, in a pool, waiting for a rollout
        LEASED = "leased"  # a rollout uses it
        STOPPING = "stopping"
        STOPPED = "stopped"
        FAILED = "failed"

    class Pool(models.TextChoices):
        ROOT = "root"  # the task's fresh initial state
        FORK = "fork"  # forked from a snapshot

    task = models.ForeignKey("cache.Task", on_delete=models.CASCADE, related_name="sandboxes")
    backend = models.CharField(max_length=40)
    # The docker engine that holds it (sandboxes/engines.py: its URL; "" for the one engine of a
    # deployment that names none, and for the backends that run on this host).
    engine = models.CharField(max_length=200, blank=True, default="")
    ref = models.CharField(max_length=200, blank=True, default="")  # the backend's sandbox id
    pool = models.CharField(max_length=10, choices=Pool.choices)
    snapshot = models.ForeignKey(
        "cache.Snapshot", null=True, blank=True, on_delete=models.SET_NULL, related_name="forks"
    )
    state = models.CharField(max_length=10, choices=State.choices, default=State.WARMING)
    rollout = models.ForeignKey(
        "cache.Rollout", null=True, blank=True, on_delete=models.SET_NULL, related_name="sandboxes"
    )
    applied = models.PositiveIntegerField(default=0)  # leading calls of the rollout's history it reflects
    # Set (and committed) before a call runs in the sandbox, cleared once its outcome is stored: a
    # sandbox found executing by its rollout's next call was cut off mid-call (a killed server)
    # and may be ahead of the history, so it is retired.
    executing = models.BooleanField(default=False, db_default=False)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    start_ms = models.FloatField(null=True, blank=True)  # start or fork latency
    error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["task", "state", "pool"], name="sandbox_pool"),
            models.Index(fields=["state"], condition=~Q(state="stopped"), name="sandbox_live"),
        ]

    def __str__(self) -> str:
        return f"{self.backend}:{self.ref or '-'} ({self.state})"
