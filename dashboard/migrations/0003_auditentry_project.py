import django.db.models.deletion
from django.db import migrations, models


def entries_of_default(apps, schema_editor):
    Project = apps.get_model("cache", "Project")
    AuditEntry = apps.get_model("dashboard", "AuditEntry")
    default = Project.objects.filter(name="default").first()
    if default is not None:
        AuditEntry.objects.exclude(task_id="").update(project=default)


class Migration(migrations.Migration):
    dependencies = [
        ("cache", "0010_projects_required"),
        ("dashboard", "0002_tool_uncacheable"),
    ]

    operations = [
        migrations.AlterField(
            model_name="auditentry",
            name="action",
            field=models.CharField(
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
        migrations.AlterField(
            model_name="auditentry",
            name="task_id",
            field=models.CharField(blank=True, db_index=True, default="", max_length=251),
        ),
        migrations.AddField(
            model_name="auditentry",
            name="project",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="+",
                to="cache.project",
            ),
        ),
        migrations.RunPython(entries_of_default, migrations.RunPython.noop),
    ]
