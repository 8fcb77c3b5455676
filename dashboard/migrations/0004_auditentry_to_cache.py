"""The audit log is the cache app's now (cache migration 0011 took the model and its table over):
the model leaves this app's state only; the table and its rows stay."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("cache", "0011_auditentry"),
        ("dashboard", "0003_auditentry_project"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(state_operations=[migrations.DeleteModel(name="AuditEntry")]),
    ]
