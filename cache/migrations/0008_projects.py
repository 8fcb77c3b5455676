"""Projects and scoped tokens (docs/operations/projects.md): the tables, and the columns of tasks
and tokens (filled by 0009, required by 0010: each migration is a transaction of its own, and
PostgreSQL refuses to alter a table with row changes pending in the same one)."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("cache", "0007_node_divergent_state"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="Project",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
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
                ("rate_limit", models.PositiveIntegerField(blank=True, help_text="Requests per second.", null=True)),
                (
                    "rate_burst",
                    models.PositiveIntegerField(blank=True, help_text="Default: one second's worth.", null=True),
                ),
            ],
        ),
        migrations.CreateModel(
            name="Membership",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                (
                    "role",
                    models.CharField(
                        choices=[("trainer", "trainer"), ("maintainer", "maintainer")], default="trainer", max_length=12
                    ),
                ),
                (
                    "project",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name="memberships", to="cache.project"
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
                blank=True, related_name="projects", through="cache.Membership", to=settings.AUTH_USER_MODEL
            ),
        ),
        migrations.CreateModel(
            name="ProjectRequests",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("minute", models.DateTimeField()),
                ("admitted", models.PositiveIntegerField(default=0)),
                ("refused", models.PositiveIntegerField(default=0)),
                (
                    "project",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name="request_minutes", to="cache.project"
                    ),
                ),
            ],
            options={
                "constraints": [models.UniqueConstraint(fields=("project", "minute"), name="project_requests_minute")],
            },
        ),
        # Keys of other projects are longer than ids: "<project>.<id>". The columns that refer to
        # a task's key follow (Django alters the foreign keys' columns with the primary key).
        migrations.AlterField(
            model_name="task",
            name="id",
            field=models.CharField(max_length=251, primary_key=True, serialize=False),
        ),
        migrations.AlterField(
            model_name="claim",
            name="task_id",
            field=models.CharField(max_length=251),
        ),
        migrations.AddField(
            model_name="task",
            name="project",
            field=models.ForeignKey(
                null=True, on_delete=django.db.models.deletion.PROTECT, related_name="tasks", to="cache.project"
            ),
        ),
        migrations.AddField(
            model_name="task",
            name="name",
            field=models.SlugField(db_index=False, default="", max_length=200),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name="apitoken",
            name="project",
            field=models.ForeignKey(
                null=True, on_delete=django.db.models.deletion.PROTECT, related_name="tokens", to="cache.project"
            ),
        ),
        migrations.AddField(
            model_name="apitoken",
            name="role",
            field=models.CharField(
                choices=[("trainer", "trainer"), ("maintainer", "maintainer")], default="trainer", max_length=12
            ),
        ),
        migrations.AddField(
            model_name="apitoken",
            name="expires_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="apitoken",
            name="last_used_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
