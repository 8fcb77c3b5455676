"""Indexes that retention's deletes left sparse are rebuilt (cache/services/maintenance.py,
indexes_rebuild): a B-tree of ever-growing ids keeps every page a surviving row holds, so it grows
while its table holds; the periodic job rebuilds it, reads and writes going on."""

from __future__ import annotations

import pytest
from django.db import connection

from cache.models import Rollout, RolloutStep, Task
from cache.services import indexes_rebuild
from cache.services.maintenance import btree_need

pytestmark = pytest.mark.django_db(transaction=True)

ROWS = 100_000


def size(index: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_relation_size(%s::regclass)", [index])
        return cursor.fetchone()[0]


def test_an_index_left_sparse_is_rebuilt_and_its_rows_stay(api):
    assert api.put("/api/v1/tasks/sparse", {"env": {"backend": "external"}}, format="json").status_code == 201
    rollout = Rollout.objects.create(task=Task.objects.get(name="sparse"), rollout_id="r")
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO cache_rolloutstep (rollout_id, applied, at, node_id, hit) "
            "SELECT %s, g, g, g, false FROM generate_series(1, %s) g",
            [rollout.pk, ROWS],
        )
        # Retention's kind of delete: old and new rows alike, a few left on every page.
        cursor.execute("DELETE FROM cache_rolloutstep WHERE applied % 50 <> 0")
        cursor.execute("VACUUM (ANALYZE) cache_rolloutstep")
    sparse = size("cache_rolloutstep_pkey")
    assert sparse > 4 * btree_need(ROWS // 50, 8)  # vacuumed, and as big as with every row

    rebuilt = indexes_rebuild(min_excess=0)

    assert {"cache_rolloutstep_pkey", "rolloutstep_order"} <= set(rebuilt)
    assert size("cache_rolloutstep_pkey") < sparse / 4
    steps = RolloutStep.objects.filter(rollout=rollout)
    assert steps.count() == ROWS // 50 and steps.filter(applied=5000).exists()
    assert indexes_rebuild(min_excess=0) == []  # dense now: nothing to do
