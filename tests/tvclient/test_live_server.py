"""tvclient against a live tvcache server (real HTTP, real PostgreSQL)."""

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest

from accounts.services.tokens import token_create
from tvclient import (
    AsyncToolCallExecutor,
    FolderEnvironment,
    InMemoryEnvironment,
    SnapshotStore,
    ToolCallExecutor,
    TVCacheClient,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def client(live_server):
    with TVCacheClient(live_server.url, token_create(name="live")) as client:
        yield client


def run(client, task_id, env_factory, calls, *, rollout_id, epoch, snapshots):
    with ToolCallExecutor(
        client, task_id, env_factory, rollout_id=rollout_id, epoch=epoch, snapshots=snapshots
    ) as executor:
        results = [executor.execute(call) for call in calls]
        return results, executor


def test_in_memory_environment_hits_and_matches_fresh_execution(client):
    client.put_task(
        "kv",
        env={"backend": "external", "kv": 1},
        tools={"get": {"mutates_state": False}, "list": {"mutates_state": False}},
        sandbox_budget=4,
    )
    calls = [
        {"tool": "set", "args": {"key": "a", "value": "1"}},
        {"tool": "get", "args": {"key": "a"}},
        {"tool": "append", "args": {"key": "a", "value": "2"}},
        {"tool": "get", "args": {"key": "a"}},
    ]
    store = SnapshotStore()
    first, ex1 = run(client, "kv", InMemoryEnvironment, calls, rollout_id="r1", epoch=0, snapshots=store)
    second, ex2 = run(client, "kv", InMemoryEnvironment, calls, rollout_id="r2", epoch=1, snapshots=store)
    assert first == second
    assert first[-1] == {"value": "12"}
    assert (ex1.hits, ex2.hits) == (0, 4)
    branch = calls[:3] + [{"tool": "set", "args": {"key": "b", "value": "x"}}, {"tool": "get", "args": {"key": "a"}}]
    third, ex3 = run(client, "kv", InMemoryEnvironment, branch, rollout_id="r3", epoch=1, snapshots=store)
    assert third[-1] == first[-1]  # the read after an unrelated write sees the same value, freshly executed
    assert ex3.hits == 3 and ex3.misses == 2
    stats = client.stats("kv")
    assert stats["hits"] == 7 and stats["oracle_hits"] == 7
    store.close()


def test_a_write_that_changed_nothing_is_keyed_as_read_only(client):
    client.put_task(
        "kv-observed", env={"backend": "external", "kv": 2}, tools={"get": {"mutates_state": False}}, sandbox_budget=4
    )
    set_a, append = (
        {"tool": "set", "args": {"key": "a", "value": "1"}},
        {"tool": "append", "args": {"key": "a", "value": "2"}},
    )
    get = {"tool": "get", "args": {"key": "a"}}
    store = SnapshotStore()
    # r1 sets `a` twice: the environment sees that the second set changed nothing.
    first, ex1 = run(
        client,
        "kv-observed",
        InMemoryEnvironment,
        [set_a, set_a, append, get],
        rollout_id="r1",
        epoch=0,
        snapshots=store,
    )
    assert ex1.history == (set_a, append)  # what changed the state
    # r2 sets it once: its append and get are r1's.
    second, ex2 = run(
        client, "kv-observed", InMemoryEnvironment, [set_a, append, get], rollout_id="r2", epoch=0, snapshots=store
    )
    assert (second[-1], ex2.hits) == (first[-1], 3) and first[-1] == {"value": "12"}
    # r3 repeats r1's: the repeated set is a hit that the service marks read-only.
    third, ex3 = run(
        client, "kv-observed", InMemoryEnvironment, [set_a, set_a, get], rollout_id="r3", epoch=0, snapshots=store
    )
    assert (third[-1], ex3.hits, ex3.history) == ({"value": "1"}, 2, (set_a,))
    store.close()


class SlowFolder(FolderEnvironment):
    """Writes take 80 ms, so a two-write setup costs more than a snapshot plus a restore."""

    def execute(self, call):
        if call["tool"] == "write_file":
            time.sleep(0.08)
        return super().execute(call)


def test_folder_environment_resumes_from_a_snapshot_and_replays_only_the_suffix(client):
    client.put_task(
        "repo",
        env={"backend": "external", "repo": 1},
        tools={"read_file": {"mutates_state": False}, "list_dir": {"mutates_state": False}},
        sandbox_budget=4,
    )
    store = SnapshotStore()
    setup = [
        {"tool": "write_file", "args": {"path": "a.txt", "content": "A"}},
        {"tool": "write_file", "args": {"path": "b.txt", "content": "B"}},
    ]
    _, first = run(client, "repo", partial(SlowFolder, None), setup, rollout_id="r1", epoch=0, snapshots=store)
    assert len(store) == 1
    assert [n["snapshot"] for n in client.graph("repo")["nodes"]] == [False, True]
    extra = {"tool": "write_file", "args": {"path": "c.txt", "content": "C"}}
    read = {"tool": "read_file", "args": {"path": "a.txt"}}
    results, second = run(
        client, "repo", partial(SlowFolder, None), [*setup, extra, read], rollout_id="r2", epoch=0, snapshots=store
    )
    assert (second.hits, second.misses, second.replayed) == (2, 2, 0)  # forked at the snapshot: no replay
    assert results[-1] == {"output": "A", "ok": True}
    store.close()


class SlowEnvironment(InMemoryEnvironment):
    """A store whose calls take a while."""

    def execute(self, call):
        time.sleep(0.3)
        return super().execute(call)


def test_rollouts_missing_on_the_same_call_at_once_execute_it_once(client):
    client.put_task(
        "kv-flight", env={"backend": "external", "kv": 3}, tools={"get": {"mutates_state": False}}, sandbox_budget=4
    )
    calls = [{"tool": "set", "args": {"key": "a", "value": "1"}}, {"tool": "get", "args": {"key": "a"}}]
    with ThreadPoolExecutor(4) as pool:
        runs = list(
            pool.map(
                lambda r: run(client, "kv-flight", SlowEnvironment, calls, rollout_id=f"r{r}", epoch=0, snapshots=None),
                range(4),
            )
        )
    assert [results for results, _ in runs] == [[{"value": "1"}, {"value": "1"}]] * 4
    # Each looked-up call executed once, by whichever rollout claimed it first (a rollout that
    # took `set` from the cache and then claimed `get` also replays `set` to build its state).
    assert sum(executor.executed for _, executor in runs) == 2
    assert sum(executor.waited for _, executor in runs) >= 3
    assert client.stats("kv-flight")["hits"] == 6


class DiceEnvironment(InMemoryEnvironment):
    """The key-value store plus `roll`, a read-only tool whose answer is random: not deterministic."""

    def execute(self, call):
        if call["tool"] == "roll":
            self.executions += 1
            return {"value": uuid.uuid4().hex}
        return super().execute(call)

    def mutates_state(self, call) -> bool:
        return call["tool"] not in {*self.READ_ONLY, "roll"}


def test_a_sampled_hit_re_executed_by_the_client_is_found_divergent_and_no_longer_served(client):
    task = client.put_task(
        "dice",
        env={"backend": "external", "dice": 1},
        tools={"get": {"mutates_state": False}, "roll": {"mutates_state": False}},
        audit_rate=1.0,
    )
    assert task["audit_rate"] == 1.0
    set_a, get_a, roll = (
        {"tool": "set", "args": {"key": "a", "value": "1"}},
        {"tool": "get", "args": {"key": "a"}},
        {"tool": "roll", "args": {}},
    )
    store = SnapshotStore()
    first, _ = run(client, "dice", DiceEnvironment, [set_a, roll], rollout_id="r1", epoch=0, snapshots=store)
    # r2's get misses and opens its environment at [set a]: the roll's hit is audited there.
    second, ex2 = run(client, "dice", DiceEnvironment, [set_a, get_a, roll], rollout_id="r2", epoch=0, snapshots=store)
    assert second[2] == first[1]  # the hit's answer
    assert (ex2.audited, ex2.divergent, ex2.audits_skipped) == (1, 1, 1)  # the hit of `set a` changes state
    third, ex3 = run(client, "dice", DiceEnvironment, [set_a, roll], rollout_id="r3", epoch=0, snapshots=store)
    assert third[1] != first[1] and ex3.misses == 1  # no longer served
    divergences = client.stats("dice")["divergences"]
    assert divergences["count"] == 1 and divergences["per_tool"][0]["tool"] == "roll"
    store.close()


def test_branches_continue_a_rollout_after_its_last_call_as_a_miss_would(client):
    client.put_task("kv-branch", env={"backend": "external", "kv": 3}, tools={"get": {"mutates_state": False}})
    store = SnapshotStore()
    made = []

    def factory():
        made.append(InMemoryEnvironment())
        return made[-1]

    setup = [
        {"tool": "set", "args": {"key": "a", "value": "1"}},
        {"tool": "append", "args": {"key": "a", "value": "2"}},
    ]
    with ToolCallExecutor(client, "kv-branch", factory, rollout_id="r1", epoch=0, snapshots=store) as parent:
        for call in setup:
            parent.execute(call)
        branches = parent.branch(3, rollout_ids=["b0", "b1", "b2"])
        parent.execute({"tool": "append", "args": {"key": "a", "value": "parent"}})  # after the branch point
        for i, branch in enumerate(branches):
            assert branch.history == parent.history[:2] and branch.branch_of == ("r1", 2)
            assert branch.execute({"tool": "append", "args": {"key": "a", "value": str(i)}}) is not None
            assert branch.execute({"tool": "get", "args": {"key": "a"}}) == {"value": f"12{i}"}
            assert (branch.hits, branch.misses) == (0, 2)
            branch.close()
        # Each branch's environment was opened by its first miss: forked or replayed, never the parent's.
        assert all(branch.env is not parent.env for branch in branches)
        with pytest.raises(ValueError):
            parent.branch(2, rollout_ids=["x", "x"])
    store.close()


def test_async_branches(client):
    client.put_task("kv-branch-async", env={"backend": "external", "kv": 4}, tools={"get": {"mutates_state": False}})

    async def go():
        parent = AsyncToolCallExecutor(client, "kv-branch-async", InMemoryEnvironment, rollout_id="r1")
        await parent.execute({"tool": "set", "args": {"key": "a", "value": "1"}})
        (branch,) = await parent.branch(1)
        answer = await branch.execute({"tool": "get", "args": {"key": "a"}})
        await branch.aclose()
        await parent.aclose()
        return answer, branch.executor.branch_of

    assert asyncio.run(go()) == ({"value": "1"}, ("r1", 1))


def test_an_epoch_of_branches_exports_as_its_packing_groups(client):
    """Client-mode rollouts and branches, with their token spans, read back as Tree Training's
    packing groups (tvclient.trees over GET /tasks/{id}/tree)."""
    from tvclient import trees

    client.put_task("kv-tree", env={"backend": "external", "kv": 5}, tools={"get": {"mutates_state": False}})
    put = [{"tool": "set", "args": {"key": "a", "value": str(i)}} for i in range(3)]
    with ToolCallExecutor(
        client, "kv-tree", InMemoryEnvironment, rollout_id="r1", epoch=7, trajectory_ref="traj-r1"
    ) as root:
        root.execute(put[0], tokens={"prompt": [0, 100], "completion": [100, 120]})
        root.execute(put[1], tokens={"prompt": [0, 150], "completion": [150, 170]})
        branches = root.branch(2, rollout_ids=["b0", "b1"], tokens={"prompt": [0, 160]}, trajectory_refs=["tb0", "tb1"])
        root.execute(put[2], tokens={"prompt": [0, 200], "completion": [200, 230]})
        for i, branch in enumerate(branches):
            with branch:
                branch.execute(
                    {"tool": "get", "args": {"key": "a"}}, tokens={"prompt": [0, 160], "completion": [160, 190 + i]}
                )
    export = trees.iter_export(client, "kv-tree", epoch=7)
    rollouts = {r.rollout_id: r for r in export.rollouts}
    assert set(rollouts) == {"r1", "b0", "b1"}
    assert rollouts["r1"].trajectory_ref == "traj-r1" and rollouts["b1"].trajectory_ref == "tb1"
    assert [c.cached for c in rollouts["r1"].calls] == [False, False, False]
    assert (rollouts["b0"].branch.rollout, rollouts["b0"].branch.step) == ("r1", 2)
    (group,) = trees.packing_groups(export)
    first, *children = [(t.rollout_id, t.parent, t.shared, t.length) for t in group.trajectories]
    assert [first, *sorted(children)] == [
        ("r1", None, 0, 230),
        ("b0", "r1", 160, 190),
        ("b1", "r1", 160, 191),
    ]
    assert (group.flat_tokens, group.tree_tokens) == (230 + 190 + 191, 230 + 30 + 31)
