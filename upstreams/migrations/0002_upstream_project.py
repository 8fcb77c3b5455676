"""Upstreams belong to projects (docs/operations/projects.md): a name is unique within its project.
Filled by 0003, required by 0004 (each migration a transaction of its own)."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("cache", "0010_projects_required"),
        ("upstreams", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="upstream",
            name="project",
            field=models.ForeignKey(
                null=True, on_delete=django.db.models.deletion.PROTECT, related_name="upstreams", to="cache.project"
            ),
        ),
        migrations.AlterField(
            model_name="upstream",
            name="name",
            field=models.SlugField(db_index=False, max_length=100),
        ),
    ]
