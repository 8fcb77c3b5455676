"""Projects, their members and their API tokens, and the requests each project makes: who may use
the service and how much. Keys, roles and names come from `accounts.projects`."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from accounts.projects import DEFAULT_PROJECT, MAX_PROJECT_NAME, ROLES, TRAINER

ROLE_CHOICES = [(role, role) for role in ROLES]


class Project(models.Model):
    """Owns tasks (and through them rollouts, snapshots and sandboxes), tokens and upstreams; has
    members (dashboard users). The operator's grants bound what its tasks may ask for and use,
    within the service's own maxima (settings TVCACHE_DOCKER_*); null: no bound of the project's
    own (the service's maximum applies)."""

    name = models.SlugField(max_length=MAX_PROJECT_NAME, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Docker: network access (also needs TVCACHE_DOCKER_ALLOW_NETWORK), the images its tasks may
    # name ([]: every image the service runs), and caps on a sandbox's limits.
    network = models.BooleanField(default=False, help_text="Docker network access (the service must allow it too).")
    images = models.JSONField(default=list, blank=True, help_text="Images its tasks may name; empty: the service's.")
    max_memory_mb = models.PositiveIntegerField(null=True, blank=True)
    max_cpus = models.FloatField(null=True, blank=True)
    max_pids = models.PositiveIntegerField(null=True, blank=True)
    # Quotas: sandboxes running at once (pools included), bytes of live snapshots, and requests per
    # second (a token bucket per server process of `rate_burst` requests, refilled at the rate).
    max_live_sandboxes = models.PositiveIntegerField(null=True, blank=True)
    max_snapshot_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    rate_limit = models.PositiveIntegerField(null=True, blank=True, help_text="Requests per second.")
    rate_burst = models.PositiveIntegerField(null=True, blank=True, help_text="Default: one second's worth.")
    # Retention defaults for its tasks (a task's own bound wins; NULL: unbounded).
    task_max_nodes = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Nodes each task keeps at most, unless the task sets its own; empty: unbounded.",
    )
    task_max_result_bytes = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        help_text="Result bytes each task keeps at most, unless the task sets its own; empty: unbounded.",
    )
    members = models.ManyToManyField(
        settings.AUTH_USER_MODEL, through="Membership", related_name="projects", blank=True
    )

    def __str__(self) -> str:
        return self.name

    @classmethod
    def default(cls) -> Project:
        return cls.objects.get(name=DEFAULT_PROJECT)


class Membership(models.Model):
    """A dashboard user's part in a project: a trainer sees it, a maintainer also uses its controls
    (evict, pin, flush, budget, stop a sandbox). Staff see and control every project."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=12, choices=ROLE_CHOICES, default=TRAINER)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "user"], name="membership_unique")]

    def __str__(self) -> str:
        return f"{self.user} in {self.project} ({self.role})"


class ProjectRequests(models.Model):
    """API requests of a project per minute, written with the lookup counters by the cache's ledger
    (accounts.hooks): the request rate the project page shows against the grant. Rows older than a
    day are deleted (accounts.services.projects.project_requests_prune)."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="request_minutes")
    minute = models.DateTimeField()
    admitted = models.PositiveIntegerField(default=0)
    refused = models.PositiveIntegerField(default=0)  # over the rate limit (429)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "minute"], name="project_requests_minute")]


class ApiToken(models.Model):
    """A token of one project with a role (trainer or maintainer). Only its sha256 is stored; the
    key is printed once at creation. Revoked or expired, it is refused within
    TOKEN_CACHE_TTL_S (accounts.services.tokens) in every server process."""

    name = models.CharField(max_length=100, unique=True)
    key_digest = models.CharField(max_length=64, unique=True)
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="tokens")
    role = models.CharField(max_length=12, choices=ROLE_CHOICES, default=TRAINER)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)  # to the minute (written at most once a minute)

    def __str__(self) -> str:
        return self.name
