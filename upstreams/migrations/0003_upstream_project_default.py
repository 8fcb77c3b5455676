"""Upstreams registered before projects are the default project's (as their tasks are)."""

from django.db import migrations


def into_default(apps, schema_editor):
    Project = apps.get_model("cache", "Project")
    Upstream = apps.get_model("upstreams", "Upstream")
    if Upstream.objects.exists():
        default, _ = Project.objects.get_or_create(name="default", defaults={"network": True})
        Upstream.objects.update(project=default)


class Migration(migrations.Migration):
    dependencies = [
        ("upstreams", "0002_upstream_project"),
    ]

    operations = [
        migrations.RunPython(into_default, migrations.RunPython.noop),
    ]
