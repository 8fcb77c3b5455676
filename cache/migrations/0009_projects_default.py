"""Everything that exists moves to the `default` project: its tasks keep their ids as keys
(cache.projects.task_key), and its tokens become maintainers, as every token could do everything
before. The default project keeps the service-wide network rule (TVCACHE_DOCKER_ALLOW_NETWORK
alone decides), as before."""

from django.db import migrations, models


def move_into_default(apps, schema_editor):
    Project = apps.get_model("cache", "Project")
    Task = apps.get_model("cache", "Task")
    ApiToken = apps.get_model("cache", "ApiToken")
    default, _ = Project.objects.get_or_create(name="default", defaults={"network": True})
    Task.objects.update(project=default, name=models.F("id"))
    ApiToken.objects.update(project=default, role="maintainer")


class Migration(migrations.Migration):
    dependencies = [
        ("cache", "0008_projects"),
    ]

    operations = [
        migrations.RunPython(move_into_default, migrations.RunPython.noop),
    ]
