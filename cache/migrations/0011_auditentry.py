"""The audit log moves from the dashboard app to the cache app, with its rows: the model is taken
over as it is in the state (its table, dashboard_auditentry, untouched), then the table is renamed
to this app's name, and its content type follows (the permissions and admin log entries that
refer to it stay). The dashboard's migration 0004 drops the model from its own state only."""

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


def content_type_moved(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    if not ContentType.objects.filter(app_label="cache", model="auditentry").exists():
        ContentType.objects.filter(app_label="dashboard", model="auditentry").update(app_label="cache")


class Migration(migrations.Migration):
    dependencies = [
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
        ("cache", "0010_projects_required"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("dashboard", "0003_auditentry_project"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="AuditEntry",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("at", models.DateTimeField(db_index=True, default=django.utils.timezone.now)),
                        ("actor_name", models.CharField(max_length=150)),
                        (
                            "action",
                            models.CharField(
                                choices=[
                                    ("subtree_evict", "Evict subtree"),
                                    ("snapshot_evict", "Evict snapshot"),
                                    ("node_pin", "Pin node"),
                                    ("node_unpin", "Unpin node"),
                                    ("task_flush", "Flush task"),
                                    ("budget_set", "Set budget"),
                                    ("sandbox_stop", "Stop sandbox"),
                                    ("tool_uncacheable", "Tool made uncacheable (audit)"),
                                    ("task_update", "Change task (env, tools, budget)"),
                                ],
                                max_length=40,
                            ),
                        ),
                        ("task_id", models.CharField(blank=True, db_index=True, default="", max_length=251)),
                        ("target", models.CharField(max_length=300)),
                        (
                            "outcome",
                            models.CharField(
                                choices=[("ok", "Ok"), ("refused", "Refused"), ("failed", "Failed")], max_length=10
                            ),
                        ),
                        ("details", models.JSONField(blank=True, default=dict)),
                        (
                            "actor",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                related_name="+",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                        (
                            "project",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                related_name="+",
                                to="cache.project",
                            ),
                        ),
                    ],
                    options={
                        "verbose_name_plural": "audit entries",
                        "ordering": ["-at", "-id"],
                        "db_table": "dashboard_auditentry",
                    },
                ),
            ]
        ),
        migrations.AlterModelTable(name="auditentry", table=None),
        migrations.RunPython(content_type_moved, migrations.RunPython.noop),
    ]
