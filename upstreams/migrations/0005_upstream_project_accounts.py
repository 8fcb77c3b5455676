"""An upstream's project is accounts.Project now (the accounts app's migration 0001 renamed the
table; the database's foreign key followed it): the field is repointed in the state only, before
the cache's migration 0016 drops cache.Project from its state."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0001_initial"),
        ("upstreams", "0004_upstream_project_required"),
    ]
    run_before = [("cache", "0016_projects_to_accounts")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="upstream",
                    name="project",
                    field=models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT, related_name="upstreams", to="accounts.project"
                    ),
                ),
            ],
        ),
    ]
