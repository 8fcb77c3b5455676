"""The retention soak (`manage.py soak_retention`) at a tiny size: it evicts, checks every hit
against the recorded bytes, tells evicted misses from lost ones, and leaves nothing behind. A test
of the harness and of retention under a running workload, not of timings."""

from __future__ import annotations

import io
import json

import pytest
from django.conf import settings
from django.core.management import call_command

from cache.models import Task

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("drivers", [1, 2])
def test_a_short_soak_evicts_checks_every_hit_and_loses_nothing(tmp_path, monkeypatch, drivers):
    monkeypatch.setitem(settings.TVCACHE, "RETENTION_LIVE_S", settings.TVCACHE["RETENTION_LIVE_S"])  # it sets it
    out = tmp_path / "retention.json"
    options = {
        "--tasks": 2,
        "--rollouts": 3,
        "--steps": 8,
        "--calls": 8,
        "--max-nodes": 12,
        "--drift": 2,
        "--checkpoint-steps": 4,
        "--collect-seconds": 0.3,
        "--live-seconds": 0,
        "--sample": 100,
        "--minutes": 4,
        "--drivers": drivers,
        "--out": out,
    }
    call_command("soak_retention", *[str(x) for pair in options.items() for x in pair], stdout=io.StringIO())
    report = json.loads(out.read_text())
    totals, last = report["totals"], report["checkpoints"][-1]
    assert report["steps_done"] == 8 and len(report["checkpoints"]) == 2
    assert totals["calls"] == 2 * 3 * 8 * 8 and totals["hits"] > 0 and totals["hits_checked"] == totals["hits"]
    assert totals["wrong_hits"] == 0 and totals["lost"] == 0
    assert last["retention"]["nodes_evicted"] > 0 and last["retention"]["failures"] == 0
    assert last["audit"]["sampled"] == 100 and last["audit"]["evicted"] > 0 and last["audit"]["lost"] == 0
    assert {"cache_node", "cache_node_heap", "cache_node_indexes", "database"} <= set(last["sizes_bytes"])
    assert not Task.objects.filter(pk__startswith="soak-").exists()
