"""A task's rollouts counted (cache.models.RolloutTotal), kept by statement-level triggers on
cache_rollout: every insert and delete, cascades included, adds its rows' change in the same
transaction. Filled from the rollouts there are. (A rollout never moves to another task.)"""

import django.db.models.deletion
from django.db import migrations, models

# One row per task changed by a statement, in the order of the key: rows are locked in one order,
# no deadlock between statements that touch several tasks.
_CHANGE = "SELECT task_id, count(*) AS n FROM {rows} GROUP BY task_id ORDER BY task_id"
TRIGGERS = f"""
CREATE FUNCTION cache_rollout_totals() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO cache_rollouttotal (task_id, rollouts) {_CHANGE.format(rows="new_rows")}
        ON CONFLICT (task_id) DO UPDATE SET rollouts = cache_rollouttotal.rollouts + excluded.rollouts;
    ELSE
        -- Only the totals there are: a task's delete cascades to its rollouts and its totals alike,
        -- and must not leave a row behind for a task it removes. Locked in key order first.
        PERFORM 1 FROM cache_rollouttotal t JOIN ({_CHANGE.format(rows="old_rows")}) c USING (task_id)
            ORDER BY t.task_id FOR UPDATE OF t;
        UPDATE cache_rollouttotal t SET rollouts = t.rollouts - c.n
        FROM ({_CHANGE.format(rows="old_rows")}) c WHERE t.task_id = c.task_id;
    END IF;
    RETURN NULL;
END
$fn$;
CREATE TRIGGER cache_rollout_totals_insert AFTER INSERT ON cache_rollout
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION cache_rollout_totals();
CREATE TRIGGER cache_rollout_totals_delete AFTER DELETE ON cache_rollout
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION cache_rollout_totals();
INSERT INTO cache_rollouttotal (task_id, rollouts) {_CHANGE.format(rows="cache_rollout")};
"""
UNTRIGGERS = """
DROP TRIGGER cache_rollout_totals_insert ON cache_rollout;
DROP TRIGGER cache_rollout_totals_delete ON cache_rollout;
DROP FUNCTION cache_rollout_totals();
"""


class Migration(migrations.Migration):
    dependencies = [
        ("cache", "0023_rollout_calls"),
    ]

    operations = [
        migrations.CreateModel(
            name="RolloutTotal",
            fields=[
                (
                    "task",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="rollout_total",
                        serialize=False,
                        to="cache.task",
                    ),
                ),
                ("rollouts", models.BigIntegerField(default=0)),
            ],
        ),
        # Taken while the triggers are made: no rollout comes or goes between the fill and the triggers.
        migrations.RunSQL("LOCK TABLE cache_rollout IN SHARE ROW EXCLUSIVE MODE;" + TRIGGERS, UNTRIGGERS),
    ]
