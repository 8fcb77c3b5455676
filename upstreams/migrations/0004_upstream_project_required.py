import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("upstreams", "0003_upstream_project_default"),
    ]

    operations = [
        migrations.AlterField(
            model_name="upstream",
            name="project",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.PROTECT, related_name="upstreams", to="cache.project"
            ),
        ),
        migrations.AddConstraint(
            model_name="upstream",
            constraint=models.UniqueConstraint(fields=("project", "name"), name="upstream_unique_name"),
        ),
    ]
