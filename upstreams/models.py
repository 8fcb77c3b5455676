"""Upstream tool servers the service caches for (verl-tool), and the trajectories it proxies."""

from __future__ import annotations

from django.db import models

from cache.models import Rollout


class Upstream(models.Model):
    """A user's own tool server; trainers reach it through the proxy path that carries its secret.
    It belongs to a project (its name is unique there), and so do the tasks its requests make."""

    class Protocol(models.TextChoices):
        VERL_TOOL = "verl-tool"

    project = models.ForeignKey("accounts.Project", on_delete=models.PROTECT, related_name="upstreams")
    name = models.SlugField(max_length=100, db_index=False)
    protocol = models.CharField(max_length=20, choices=Protocol.choices)
    url = models.URLField(max_length=2000)
    # What names a task: these fields' values in a request's extra_fields.
    task_fields = models.JSONField(default=list)
    # The call is the action reduced by this regex (its first group, or the whole match); "" = the
    # whole action. An action it does not match passes through uncached.
    action_pattern = models.TextField(blank=True, default="")
    read_only = models.BooleanField(default=False)  # the upstream's actions never change its state
    ignore_fields = models.JSONField(default=list)  # extra fields left out of the call
    timeout_s = models.FloatField(default=120.0)
    # The proxy path's secret is derived from this nonce and the service's SECRET_KEY (services.py);
    # only its sha256 is stored, and looked up.
    secret_nonce = models.CharField(max_length=64)
    secret_digest = models.CharField(max_length=64, unique=True)
    # Counters, in actions (upstream_requests: HTTP requests sent to the upstream, catch-up included).
    hits = models.PositiveBigIntegerField(default=0)
    misses = models.PositiveBigIntegerField(default=0)
    passed_through = models.PositiveBigIntegerField(default=0)
    upstream_requests = models.PositiveBigIntegerField(default=0)
    upstream_errors = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="upstream_unique_name")]

    def __str__(self) -> str:
        return self.name


class Trajectory(models.Model):
    """A verl-tool trajectory id: a rollout of its task, with what the upstream has seen of it.

    The rollout's history (cache Rollout.history) holds its state-changing calls. A hit adds a
    call the upstream never ran: `pending` keeps that request item (the trajectory's own raw action
    and extra fields) so that the trajectory's next miss first sends it to the upstream (catch-up).
    `applied` is how many of the history's calls the upstream has applied; the history has
    `applied + len(pending)` calls."""

    upstream = models.ForeignKey(Upstream, on_delete=models.CASCADE, related_name="trajectories")
    trajectory_id = models.CharField(max_length=200)
    rollout = models.OneToOneField(Rollout, on_delete=models.CASCADE, related_name="trajectory")
    applied = models.PositiveIntegerField(default=0)
    pending = models.JSONField(default=list)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["upstream", "trajectory_id"], name="trajectory_unique")]
