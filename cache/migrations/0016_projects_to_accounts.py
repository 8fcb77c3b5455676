"""Projects, members, request counts and API tokens now belong to the accounts app, whose migration
0001 renamed their tables (rows, ids and sequences kept). Here, in the state only: the task's and
the audit entry's foreign keys point at accounts.Project (the database's constraints followed the
renamed table), and the moved models leave the cache's state. Upstreams' 0005 repoints its own key
before this runs."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0001_initial"),
        ("cache", "0015_processes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="task",
                    name="project",
                    field=models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT, related_name="tasks", to="accounts.project"
                    ),
                ),
                migrations.AlterField(
                    model_name="auditentry",
                    name="project",
                    field=models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to="accounts.project",
                    ),
                ),
                migrations.RemoveField(model_name="project", name="members"),
                migrations.DeleteModel(name="ApiToken"),
                migrations.DeleteModel(name="Membership"),
                migrations.DeleteModel(name="ProjectRequests"),
                migrations.DeleteModel(name="Project"),
            ],
        ),
    ]
