"""Projects, their members, their request counts and API tokens move from the cache app to this one,
with their rows: the models are taken over in the state as they are, and their tables are renamed
(cache_project to accounts_project, ...), never created afresh and copied. Foreign keys follow a
renamed table in PostgreSQL, so the tasks, audit entries and upstreams that point at a project keep
pointing at it; the cache's migration 0016 (and upstreams' 0005) repoint their fields in the state
and drop the models from the cache's state. The content types follow too, so the permissions and
admin log entries that refer to them stay."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

MOVED = ("project", "membership", "projectrequests", "apitoken")
ROLES = [("trainer", "trainer"), ("maintainer", "maintainer")]


def _content_types_moved(apps, source: str, target: str) -> None:
    ContentType = apps.get_model("contenttypes", "ContentType")
    for model in MOVED:
        if not ContentType.objects.filter(app_label=target, model=model).exists():
            ContentType.objects.filter(app_label=source, model=model).update(app_label=target)


def content_types_forward(apps, schema_editor):
    _content_types_moved(apps, "cache", "accounts")


def content_types_backward(apps, schema_editor):
    _content_types_moved(apps, "accounts", "cache")


class Migration(migrations.Migration):
    initial = True

    # After every migration that reaches cache_project by its old name through the historical
    # cache.Project: upstreams' 0004 is the last (the dashboard's come before the cache's 0011).
    dependencies = [
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
        ("cache", "0015_processes"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("upstreams", "0004_upstream_project_required"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    sql=[f"ALTER TABLE cache_{model} RENAME TO accounts_{model}" for model in MOVED],
                    reverse_sql=[f"ALTER TABLE accounts_{model} RENAME TO cache_{model}" for model in MOVED],
                ),
            ],
            state_operations=[
                migrations.CreateModel(
                    name="Project",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("name", models.SlugField(unique=True)),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                        (
                            "network",
                            models.BooleanField(
                                default=False, help_text="Docker network access (the service must allow it too)."
                            ),
                        ),
                        (
                            "images",
                            models.JSONField(
                                blank=True, default=list, help_text="Images its tasks may name; empty: the service's."
                            ),
                        ),
                        ("max_memory_mb", models.PositiveIntegerField(blank=True, null=True)),
                        ("max_cpus", models.FloatField(blank=True, null=True)),
                        ("max_pids", models.PositiveIntegerField(blank=True, null=True)),
                        ("max_live_sandboxes", models.PositiveIntegerField(blank=True, null=True)),
                        ("max_snapshot_bytes", models.PositiveBigIntegerField(blank=True, null=True)),
                        (
                            "rate_limit",
                            models.PositiveIntegerField(blank=True, help_text="Requests per second.", null=True),
                        ),
                        (
                            "rate_burst",
                            models.PositiveIntegerField(
                                blank=True, help_text="Default: one second's worth.", null=True
                            ),
                        ),
                    ],
                ),
                migrations.CreateModel(
                    name="Membership",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("role", models.CharField(choices=ROLES, default="trainer", max_length=12)),
                        (
                            "project",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="memberships",
                                to="accounts.project",
                            ),
                        ),
                        (
                            "user",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="memberships",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                    ],
                    options={
                        "constraints": [models.UniqueConstraint(fields=("project", "user"), name="membership_unique")],
                    },
                ),
                migrations.AddField(
                    model_name="project",
                    name="members",
                    field=models.ManyToManyField(
                        blank=True, related_name="projects", through="accounts.Membership", to=settings.AUTH_USER_MODEL
                    ),
                ),
                migrations.CreateModel(
                    name="ProjectRequests",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("minute", models.DateTimeField()),
                        ("admitted", models.PositiveIntegerField(default=0)),
                        ("refused", models.PositiveIntegerField(default=0)),
                        (
                            "project",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="request_minutes",
                                to="accounts.project",
                            ),
                        ),
                    ],
                    options={
                        "constraints": [
                            models.UniqueConstraint(fields=("project", "minute"), name="project_requests_minute")
                        ],
                    },
                ),
                migrations.CreateModel(
                    name="ApiToken",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("name", models.CharField(max_length=100, unique=True)),
                        ("key_digest", models.CharField(max_length=64, unique=True)),
                        ("role", models.CharField(choices=ROLES, default="trainer", max_length=12)),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                        ("expires_at", models.DateTimeField(blank=True, null=True)),
                        ("revoked_at", models.DateTimeField(blank=True, null=True)),
                        ("last_used_at", models.DateTimeField(blank=True, null=True)),
                        (
                            "project",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="tokens",
                                to="accounts.project",
                            ),
                        ),
                    ],
                ),
            ],
        ),
        migrations.RunPython(content_types_forward, content_types_backward),
    ]
