import subprocess
import sys

from cache.tcg import ToolCall, call_digest, canonical_call, env_fingerprint
from cache.tcg.eviction import SnapshotCandidate, eviction_order
from cache.tcg.snapshots import SnapshotCosts, moving_average, snapshot_after_ms, snapshot_wanted


def test_canonical_call_sorts_keys_at_every_level_and_has_no_whitespace():
    call = ToolCall("bash", {"b": 1, "a": {"y": [1, 2], "x": "é"}})
    assert canonical_call(call) == '{"args":{"a":{"x":"é","y":[1,2]},"b":1},"tool":"bash"}'.encode()
    assert call_digest(call) == call_digest(ToolCall("bash", {"a": {"x": "é", "y": [1, 2]}, "b": 1}))


def test_fingerprint_changes_with_the_environment_spec():
    assert env_fingerprint({"image": "a"}) != env_fingerprint({"image": "b"})
    assert env_fingerprint({"x": 1, "y": 2}) == env_fingerprint({"y": 2, "x": 1})


def test_snapshot_only_when_replay_costs_more_than_snapshot_plus_restore():
    costs = SnapshotCosts(snapshot_ms=100, restore_ms=50)
    assert snapshot_wanted(mutates=True, replay_cost_ms=151, costs=costs)
    assert not snapshot_wanted(mutates=True, replay_cost_ms=150, costs=costs)
    assert not snapshot_wanted(mutates=False, replay_cost_ms=10_000, costs=costs)
    # A state with live processes: only a snapshot that keeps them is worth taking.
    assert not snapshot_wanted(mutates=True, replay_cost_ms=10_000, costs=costs, live_processes=1)
    assert snapshot_wanted(mutates=True, replay_cost_ms=10_000, costs=costs, live_processes=1, keeps_processes=True)


def test_snapshot_after_ms_is_the_run_time_past_which_the_call_is_snapshotted():
    costs = SnapshotCosts(snapshot_ms=100, restore_ms=50)
    after = snapshot_after_ms(replay_cost_ms=30, costs=costs)
    assert after == 120
    assert snapshot_wanted(mutates=True, replay_cost_ms=30 + after + 1, costs=costs)
    assert not snapshot_wanted(mutates=True, replay_cost_ms=30 + after, costs=costs)
    assert snapshot_after_ms(replay_cost_ms=500, costs=costs) == 0.0


def test_moving_average_starts_at_the_first_sample():
    assert moving_average(None, 10) == 10
    assert moving_average(10, 20, weight=0.5) == 15


def candidate(snapshot_id, **kw):
    base = dict(hit_count=0, children=0, depth=1, rebuild_ms=1000, idle_s=0)
    return SnapshotCandidate(snapshot_id=snapshot_id, **{**base, **kw})


def test_eviction_spares_leased_and_pinned_and_prefers_cold_cheap_deep():
    candidates = [
        candidate(1, hit_count=10),
        candidate(2, leased=True),
        candidate(3, pinned=True),
        candidate(4, depth=10),
        candidate(5, rebuild_ms=10),
    ]
    assert eviction_order(candidates, 2) == [5, 4]
    assert set(eviction_order(candidates, 10)) == {1, 4, 5}
    assert eviction_order(candidates, 0) == []


def test_core_imports_no_framework():
    code = (
        "import sys, cache.tcg, cache.tcg.graph, cache.tcg.eviction, cache.tcg.snapshots; "
        "bad = [m for m in sys.modules if m.split('.')[0] in {'django','rest_framework','celery','channels','docker'}]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
