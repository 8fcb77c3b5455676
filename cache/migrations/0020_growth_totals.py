"""Per-task totals of the graph (TaskTotal), backfilled from the nodes there are; the graph page's
index (task, depth, id) in place of (task, depth) and of the foreign key's two on task_id; live
snapshots by task and creation time (with what counts and lists read), evicted ones by task, a
task's rollouts by start; a node's three keys as their 32 bytes (bytea) instead of
64 hex characters, in one rewrite of the table. docs/operations/growth.md says why.

Run it with the service stopped: a record committed while the backfill reads would be counted
twice (by the backfill and by its own statement) or not at all."""

import django.contrib.postgres.fields
import django.db.models.deletion
from django.db import migrations, models

import cache.models

# Frozen here as cache.tcg.exectimes had them (6 buckets per octave, 120 buckets) and as
# cache.services.totals sums nodes: the backfill must count as the service does.
BACKFILL_SQL = """
WITH per AS (
    SELECT task_id, tool, count(*) AS nodes, count(*) FILTER (WHERE parent_id IS NULL) AS roots,
           coalesce(sum(result_bytes), 0) AS result_bytes,
           count(*) FILTER (WHERE mutates AND live_processes > 0) AS process_states,
           count(*) FILTER (WHERE divergent) AS divergent
    FROM cache_node GROUP BY task_id, tool
), hist AS (
    SELECT task_id, tool, least(119, floor(ln(1 + greatest(exec_ms, 0)) * 6 / ln(2)))::int AS b, count(*) AS n
    FROM cache_node GROUP BY 1, 2, 3
)
INSERT INTO cache_tasktotal (task_id, tool, nodes, roots, result_bytes, process_states, divergent, exec_ms_buckets)
SELECT p.task_id, p.tool, p.nodes, p.roots, p.result_bytes, p.process_states, p.divergent,
       (SELECT array_agg(coalesce(h.n, 0)::int ORDER BY s.b) FROM generate_series(0, 119) AS s(b)
        LEFT JOIN hist h ON h.task_id = p.task_id AND h.tool = p.tool AND h.b = s.b)
FROM per p
"""


KEYS = ("anchor_key", "call_digest", "state_key")
KEYS_TO_BYTES = "ALTER TABLE cache_node " + ", ".join(
    f"ALTER COLUMN {key} TYPE bytea USING decode({key}, 'hex')" for key in KEYS
)
KEYS_TO_HEX = "ALTER TABLE cache_node " + ", ".join(
    f"ALTER COLUMN {key} TYPE varchar(64) USING encode({key}, 'hex')" for key in KEYS
)


class Migration(migrations.Migration):
    dependencies = [
        ("cache", "0019_retention"),
    ]

    operations = [
        migrations.CreateModel(
            name="TaskTotal",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("tool", models.CharField(max_length=200)),
                ("nodes", models.BigIntegerField(default=0)),
                ("roots", models.BigIntegerField(default=0)),
                ("result_bytes", models.BigIntegerField(default=0)),
                ("process_states", models.BigIntegerField(default=0)),
                ("divergent", models.BigIntegerField(default=0)),
                (
                    "exec_ms_buckets",
                    django.contrib.postgres.fields.ArrayField(base_field=models.IntegerField(), size=120),
                ),
            ],
        ),
        migrations.RemoveIndex(
            model_name="node",
            name="node_task_depth",
        ),
        migrations.AlterField(
            model_name="node",
            name="task",
            field=models.ForeignKey(
                db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name="nodes", to="cache.task"
            ),
        ),
        migrations.AddIndex(
            model_name="node",
            index=models.Index(fields=["task", "depth", "id"], name="node_task_depth_id"),
        ),
        migrations.AddIndex(
            model_name="snapshot",
            index=models.Index(
                condition=models.Q(("status", "live")),
                fields=["task", "created_at", "id"],
                include=("size_bytes", "backend", "keeps_processes"),
                name="snapshot_live_task",
            ),
        ),
        migrations.AddIndex(
            model_name="snapshot",
            index=models.Index(
                condition=models.Q(("status", "evicted")), fields=["task"], name="snapshot_evicted_task"
            ),
        ),
        migrations.AddIndex(
            model_name="rollout",
            index=models.Index(fields=["task", "started_at", "id"], name="rollout_task_started"),
        ),
        migrations.AddField(
            model_name="tasktotal",
            name="task",
            field=models.ForeignKey(
                db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name="totals", to="cache.task"
            ),
        ),
        migrations.AddConstraint(
            model_name="tasktotal",
            constraint=models.UniqueConstraint(fields=("task", "tool"), name="tasktotal_unique"),
        ),
        migrations.RunSQL(BACKFILL_SQL, reverse_sql=migrations.RunSQL.noop),
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(KEYS_TO_BYTES, reverse_sql=KEYS_TO_HEX)],
            state_operations=[
                migrations.AlterField(model_name="node", name=key, field=cache.models.DigestField()) for key in KEYS
            ],
        ),
    ]
