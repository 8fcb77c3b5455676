"""A rollout's kept history as a row per call (cache.models.RolloutCall) and its length, instead of
one JSON column written whole on every call; the histories there are move over."""

import django.db.models.deletion
from django.db import migrations, models

_MOVE = """
INSERT INTO cache_rolloutcall (rollout_id, position, call)
SELECT r.id, e.position - 1, e.call
FROM cache_rollout r CROSS JOIN LATERAL jsonb_array_elements(r.history) WITH ORDINALITY AS e(call, position);
UPDATE cache_rollout SET history_length = jsonb_array_length(history);
"""
_MOVE_BACK = """
UPDATE cache_rollout r SET history = coalesce(
    (SELECT jsonb_agg(c.call ORDER BY c.position) FROM cache_rolloutcall c WHERE c.rollout_id = r.id), '[]'::jsonb);
"""


class Migration(migrations.Migration):
    dependencies = [
        ("cache", "0022_snapshot_totals"),
    ]

    operations = [
        migrations.AddField(
            model_name="rollout",
            name="history_length",
            field=models.PositiveIntegerField(db_default=0, default=0),
        ),
        migrations.CreateModel(
            name="RolloutCall",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "rollout_id", "position", blank=True, editable=False, primary_key=True, serialize=False
                    ),
                ),
                ("position", models.PositiveIntegerField()),
                ("call", models.JSONField()),
                (
                    "rollout",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="kept_calls",
                        to="cache.rollout",
                    ),
                ),
            ],
        ),
        migrations.RunSQL(_MOVE, _MOVE_BACK),
        migrations.RemoveField(
            model_name="rollout",
            name="history",
        ),
    ]
