"""A task's snapshots per backend as counters (cache.models.SnapshotTotal), kept by statement-level
triggers on cache_snapshot: every insert, update and delete, cascades and COPY included, adds its
rows' change in the same transaction. Filled from the snapshots there are."""

import django.db.models.deletion
from django.db import migrations, models

# One row per (task, backend) changed by a statement: +1 / -1 per snapshot entering / leaving a
# status, in the order of the totals' key (rows are locked in one order: no deadlock between
# statements that touch several tasks).
_CHANGE = """
    SELECT task_id, backend, sum(live) AS live, sum(live_bytes) AS live_bytes,
           sum(live_processes) AS live_processes, sum(evicted) AS evicted
    FROM ({rows}) AS rows
    GROUP BY task_id, backend
    HAVING sum(live) <> 0 OR sum(live_bytes) <> 0 OR sum(live_processes) <> 0 OR sum(evicted) <> 0
    ORDER BY task_id, backend
"""
_SIGNED = """
    SELECT task_id, backend, {sign} (status = 'live')::int AS live,
           {sign} CASE WHEN status = 'live' THEN coalesce(size_bytes, 0) ELSE 0 END AS live_bytes,
           {sign} (status = 'live' AND keeps_processes)::int AS live_processes,
           {sign} (status = 'evicted')::int AS evicted
    FROM {table}
"""
_UPSERT = """
    INSERT INTO cache_snapshottotal (task_id, backend, live, live_bytes, live_processes, evicted) {change}
    ON CONFLICT (task_id, backend) DO UPDATE SET
        live = cache_snapshottotal.live + excluded.live,
        live_bytes = cache_snapshottotal.live_bytes + excluded.live_bytes,
        live_processes = cache_snapshottotal.live_processes + excluded.live_processes,
        evicted = cache_snapshottotal.evicted + excluded.evicted;
"""
NEW = _SIGNED.format(sign="+", table="new_rows")
OLD = _SIGNED.format(sign="-", table="old_rows")
TRIGGERS = f"""
CREATE FUNCTION cache_snapshot_totals() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    IF TG_OP = 'INSERT' THEN
        {_UPSERT.format(change=_CHANGE.format(rows=NEW))}
    ELSIF TG_OP = 'UPDATE' THEN
        {_UPSERT.format(change=_CHANGE.format(rows=NEW + " UNION ALL " + OLD))}
    ELSE
        -- Only the totals there are: a task's delete cascades to its snapshots and its totals
        -- alike, and must not leave a row behind for a task it removes. Locked in key order first.
        PERFORM 1 FROM cache_snapshottotal t JOIN ({_CHANGE.format(rows=OLD)}) c USING (task_id, backend)
            ORDER BY t.task_id, t.backend FOR UPDATE OF t;
        UPDATE cache_snapshottotal t SET
            live = t.live + c.live, live_bytes = t.live_bytes + c.live_bytes,
            live_processes = t.live_processes + c.live_processes, evicted = t.evicted + c.evicted
        FROM ({_CHANGE.format(rows=OLD)}) c
        WHERE t.task_id = c.task_id AND t.backend = c.backend;
    END IF;
    RETURN NULL;
END
$fn$;
CREATE TRIGGER cache_snapshot_totals_insert AFTER INSERT ON cache_snapshot
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION cache_snapshot_totals();
CREATE TRIGGER cache_snapshot_totals_update AFTER UPDATE ON cache_snapshot
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION cache_snapshot_totals();
CREATE TRIGGER cache_snapshot_totals_delete AFTER DELETE ON cache_snapshot
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION cache_snapshot_totals();
INSERT INTO cache_snapshottotal (task_id, backend, live, live_bytes, live_processes, evicted)
    {_CHANGE.format(rows=_SIGNED.format(sign="+", table="cache_snapshot"))};
"""
UNTRIGGERS = """
DROP TRIGGER cache_snapshot_totals_insert ON cache_snapshot;
DROP TRIGGER cache_snapshot_totals_update ON cache_snapshot;
DROP TRIGGER cache_snapshot_totals_delete ON cache_snapshot;
DROP FUNCTION cache_snapshot_totals();
"""


class Migration(migrations.Migration):
    dependencies = [
        ("cache", "0021_state_match"),
    ]

    operations = [
        migrations.CreateModel(
            name="SnapshotTotal",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("backend", models.CharField(max_length=40)),
                ("live", models.BigIntegerField(default=0)),
                ("live_bytes", models.BigIntegerField(default=0)),
                ("live_processes", models.BigIntegerField(default=0)),
                ("evicted", models.BigIntegerField(default=0)),
                (
                    "task",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="snapshot_totals",
                        to="cache.task",
                    ),
                ),
            ],
            options={
                "constraints": [models.UniqueConstraint(fields=("task", "backend"), name="snapshottotal_unique")],
            },
        ),
        # Taken while the triggers are made: no snapshot changes between the fill and the triggers.
        migrations.RunSQL("LOCK TABLE cache_snapshot IN SHARE ROW EXCLUSIVE MODE;" + TRIGGERS, UNTRIGGERS),
    ]
