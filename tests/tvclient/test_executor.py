import asyncio
import logging
import threading

import pytest

from tvclient import (
    AsyncToolCallExecutor,
    InMemoryEnvironment,
    SnapshotStore,
    ToolCallExecutor,
    TVCacheClient,
    UnknownTool,
)

from .fake_service import call, hit, miss, resume
from .loopback import served

TASK = "task-1"


class Factory:
    """env_factory that keeps every environment it made."""

    def __init__(self, data: dict[str, str] | None = None) -> None:
        self.data = data
        self.made: list[InMemoryEnvironment] = []

    def __call__(self) -> InMemoryEnvironment:
        env = InMemoryEnvironment(self.data)
        self.made.append(env)
        return env


def frozen(data: dict[str, str]) -> InMemoryEnvironment:
    env = InMemoryEnvironment(data)
    env.start()
    return env


def histories(service, route="record"):
    return [(seen.body["history"], seen.body["call"]) for seen in service.requests(route)]


def play_hits(service, executor, calls):
    for each in calls:
        service.script("lookup", hit({"value": "cached"}))
        executor.execute(each)


def test_hit_returns_cached_result_and_executes_nothing(service, client):
    factory = Factory()
    executor = ToolCallExecutor(client, TASK, factory, rollout_id="r1", epoch=2)
    service.script("lookup", hit({"value": "cached"}))

    assert executor.execute(call("get", key="a")) == {"value": "cached"}

    assert factory.made == []
    assert service.requests("record") == []
    assert service.requests("lookup")[0].body == {
        "history": [],
        "call": call("get", key="a"),
        "rollout_id": "r1",
        "epoch": 2,
        "claim": True,
        "seq": 0,  # the call's place in the rollout, for the tree export
    }
    assert executor.history == (call("get", key="a"),)
    assert (executor.hits, executor.misses, executor.executed) == (1, 0, 0)


def test_a_call_another_rollout_is_executing_is_waited_for_not_executed(service, client):
    factory = Factory()
    executor = ToolCallExecutor(client, TASK, factory, rollout_id="r2")
    service.script("lookup", {**miss(replay=[]), "claim": "in_flight"})
    service.script("lookup", {**miss(replay=[]), "claim": "in_flight"})
    service.script("lookup", hit({"value": "1"}))

    assert executor.execute(call("set", key="a", value="1")) == {"value": "1"}

    assert factory.made == [] and service.requests("record") == []
    assert [seen.body["claim"] for seen in service.requests("lookup")] == [True] * 3
    assert (executor.waited, executor.hits, executor.misses) == (1, 1, 0)


def test_a_failed_execution_gives_its_claim_up(service, client):
    class Failing(InMemoryEnvironment):
        def execute(self, call):
            raise RuntimeError("tool crashed")

    executor = ToolCallExecutor(client, TASK, Failing, rollout_id="r1")
    set_a = call("set", key="a", value="1")
    service.script("lookup", hit({"value": "1"}))
    executor.execute(set_a)
    service.script("lookup", {**miss(replay=[set_a], matched=1), "claim": "granted"})

    with pytest.raises(RuntimeError):
        executor.execute(call("get", key="a"))

    (released,) = service.requests("release_claim")
    assert released.body == {"history": [set_a], "call": call("get", key="a"), "rollout_id": "r1"}
    assert service.requests("record") == []


def test_a_rollout_with_an_open_environment_asks_for_no_snapshot(service, client):
    executor = ToolCallExecutor(client, TASK, Factory())
    set_a, set_b = call("set", key="a", value="1"), call("set", key="b", value="2")
    service.script("lookup", miss(replay=[]))
    executor.execute(set_a)
    service.script("lookup", miss(replay=[set_a], matched=1))
    executor.execute(set_b)
    # The first miss may fork a snapshot (the default); the second replays on its own env.
    assert ["resume" in seen.body for seen in service.requests("lookup")] == [False, True]
    assert service.requests("lookup")[1].body["resume"] is False


def test_a_miss_returns_while_its_snapshot_is_still_being_taken(service, client):
    release_fork = threading.Event()

    class SlowFork(InMemoryEnvironment):
        def fork(self):
            assert release_fork.wait(10)
            return super().fork()

    store = SnapshotStore()
    executor = ToolCallExecutor(client, TASK, SlowFork, snapshots=store)
    set_a = call("set", key="a", value="1")
    service.script("lookup", miss(replay=[]))
    service.script("record", {"node_id": 5, "created": True, "snapshot": "wanted", "evicted": []})

    assert executor.execute(set_a) == {"value": "1"}
    assert service.requests("snapshot") == [] and len(store) == 0  # the fork is still waiting
    assert executor.background_wait_ms == 0.0

    # The next miss waits for the snapshot before it moves the environment on.
    threading.Timer(0.2, release_fork.set).start()
    service.script("lookup", miss(replay=[set_a], matched=1))
    executor.execute(call("append", key="a", value="2"))
    executor.flush()  # the registration may still be on its way
    assert len(service.requests("snapshot")) == 1
    assert store.get(service.requests("snapshot")[0].body["ref"]).data == {"a": "1"}
    assert executor.background_wait_ms > 0.0  # counted: the policy's thinking did not cover it
    executor.close()


def held_back(service, *routes):
    """A handler that holds the requests of `routes` until its event is set."""
    release = threading.Event()

    def handle(request):
        if service.route(request) in routes:
            assert release.wait(10)
        return service.handle(request)

    return handle, release


def routes(service):
    return [seen.route for seen in service.seen]


def second_record(service):
    """Where the second record came, among the requests the service saw."""
    return [index for index, route in enumerate(routes(service)) if route == "record"][1]


def test_the_next_miss_waits_for_the_frozen_snapshot_not_its_registration_nor_the_lease(service):
    handle, release = held_back(service, "snapshot", "release")
    set_a, set_b = call("set", key="a", value="1"), call("set", key="b", value="2")
    store = SnapshotStore()
    store.add("snap-1", frozen({}))
    with served(handle) as url, TVCacheClient(url, "secret") as client:
        executor = ToolCallExecutor(client, TASK, Factory(), snapshots=store)
        service.script("lookup", miss(replay=[], resume=resume("snap-1", [], lease_id=9)))
        service.script("record", {"node_id": 5, "created": True, "snapshot": "wanted", "evicted": []})
        executor.execute(set_a)
        service.script("lookup", miss(replay=[set_a], matched=1))
        # Runs while the registration and the lease release are held.
        assert executor.execute(set_b) == {"value": "2"}
        assert len(store) == 2  # snap-1 and the frozen snapshot, stored before its registration
        # The second record waits for the first miss's registration: the service decides on a
        # snapshot after set_b knowing the one after set_a.
        assert sorted(routes(service)) == ["lookup", "lookup", "record"]
        release.set()
        executor.close()
    assert sorted(routes(service)[3:]) == ["record", "release", "snapshot"]
    assert routes(service).index("snapshot") < second_record(service)
    (registration,) = service.requests("snapshot")
    assert store.get(registration.body["ref"]).data == {"a": "1"}  # frozen before set_b ran
    assert histories(service) == [([], set_a), ([set_a], set_b)]


def test_the_next_miss_waits_for_the_record_that_decides_on_a_snapshot(service):
    handle, release = held_back(service, "record")
    set_a = call("set", key="a", value="1")
    store = SnapshotStore()
    with served(handle) as url, TVCacheClient(url, "secret") as client:
        executor = ToolCallExecutor(client, TASK, Factory(), snapshots=store)
        service.script("lookup", miss(replay=[]))
        service.script("record", {"node_id": 5, "created": True, "snapshot": "wanted", "evicted": []})
        executor.execute(set_a)
        threading.Timer(0.2, release.set).start()
        service.script("lookup", miss(replay=[set_a], matched=1))
        executor.execute(call("append", key="a", value="2"))
        executor.close()
    (registration,) = service.requests("snapshot")
    assert store.get(registration.body["ref"]).data == {"a": "1"}  # not {"a": "12"}
    assert executor.background_wait_ms > 0.0


def test_a_miss_likely_to_be_snapshotted_is_frozen_before_its_record_answers(service):
    handle, release = held_back(service, "record")
    set_a, set_b = call("set", key="a", value="1"), call("set", key="b", value="2")
    store = SnapshotStore()
    with served(handle) as url, TVCacheClient(url, "secret") as client:
        executor = ToolCallExecutor(client, TASK, Factory(), snapshots=store)
        service.script("lookup", miss(replay=[], snapshot_after_ms=0.0))
        service.script("record", {"node_id": 5, "created": True, "snapshot": "wanted", "evicted": []})
        executor.execute(set_a)
        service.script("lookup", miss(replay=[set_a], matched=1))
        # Runs while the first record is held: the snapshot was frozen without waiting for it.
        assert executor.execute(set_b) == {"value": "2"}
        release.set()
        executor.close()
    (registration,) = service.requests("snapshot")
    assert store.get(registration.body["ref"]).data == {"a": "1"}  # frozen before set_b ran
    assert histories(service) == [([], set_a), ([set_a], set_b)]


def test_a_snapshot_frozen_ahead_that_the_record_does_not_want_is_dropped(service, client):
    forks: list[InMemoryEnvironment] = []

    class Forking(InMemoryEnvironment):
        def fork(self) -> InMemoryEnvironment:
            forks.append(super().fork())
            return forks[-1]

    store = SnapshotStore()
    executor = ToolCallExecutor(client, TASK, Forking, snapshots=store)
    service.script("lookup", miss(replay=[], snapshot_after_ms=0.0))
    service.script("record", {"node_id": 5, "created": False, "snapshot": "skipped", "evicted": []})
    executor.execute(call("set", key="a", value="1"))
    service.script("lookup", miss(replay=[], matched=1, snapshot_after_ms=10_000.0))  # quicker: none ahead
    executor.execute(call("set", key="b", value="2"))
    executor.close()
    assert not service.requests("snapshot") and len(store) == 0
    (ahead,) = forks
    assert ahead.running is False  # stopped


def test_replays_are_recorded_after_the_last_snapshot_is_registered(service):
    handle, release = held_back(service, "snapshot")
    set_a, set_b = call("set", key="a", value="1"), call("set", key="b", value="2")
    with served(handle) as url, TVCacheClient(url, "secret") as client:
        executor = ToolCallExecutor(client, TASK, Factory())
        service.script("lookup", miss(replay=[]))
        service.script("record", {"node_id": 5, "created": True, "snapshot": "wanted", "evicted": []})
        executor.execute(set_a)
        play_hits(service, executor, [set_b])  # another rollout's: pending replay here
        threading.Timer(0.2, release.set).start()
        service.script("lookup", miss(replay=[set_a, set_b], matched=2))
        assert executor.execute(call("get", key="b")) == {"value": "2"}
        executor.close()
    assert routes(service).index("snapshot") < second_record(service)
    assert histories(service) == [([], set_a), ([set_a], set_b), ([set_a, set_b], call("get", key="b"))]


def test_an_error_after_the_freeze_is_raised_by_a_later_wait(service, client):
    failing = threading.Event()

    class FailingStore(SnapshotStore):
        def add(self, ref, env):
            assert failing.wait(10)
            raise RuntimeError("store broke")

    executor = ToolCallExecutor(client, TASK, Factory(), snapshots=FailingStore())
    set_a, set_b = call("set", key="a", value="1"), call("set", key="b", value="2")
    service.script("lookup", miss(replay=[]))
    service.script("record", {"node_id": 5, "created": True, "snapshot": "wanted", "evicted": []})
    executor.execute(set_a)
    service.script("lookup", miss(replay=[set_a], matched=1))
    assert executor.execute(set_b) == {"value": "2"}  # the snapshot was frozen: it went on
    failing.set()
    with pytest.raises(RuntimeError, match="store broke"):
        executor.flush()
    executor.flush()  # raised once
    assert histories(service) == [([], set_a), ([set_a], set_b)]
    assert service.requests("snapshot") == []
    assert len(service.requests("release")) == 0


def test_close_waits_for_every_miss_s_background_work(service):
    handle, release = held_back(service, "snapshot")
    calls = [call("set", key=key, value="1") for key in "abc"]
    with served(handle) as url, TVCacheClient(url, "secret") as client:
        executor = ToolCallExecutor(client, TASK, Factory())
        service.script("lookup", miss(replay=[]))
        service.script("record", {"node_id": 5, "created": True, "snapshot": "wanted", "evicted": []})
        executor.execute(calls[0])
        service.script("lookup", miss(replay=calls[:1], matched=1))
        executor.execute(calls[1])
        threading.Timer(0.2, release.set).start()
        service.script("lookup", miss(replay=calls[:2], matched=2))
        executor.execute(calls[2])  # waits for the second record, sent after the registration
        executor.close()
        assert routes(service).index("snapshot") < second_record(service)
    assert histories(service) == [([], calls[0]), (calls[:1], calls[1]), (calls[:2], calls[2])]


def test_close_alone_sends_the_last_record(service, client):
    executor = ToolCallExecutor(client, TASK, Factory())
    service.script("lookup", miss(replay=[]))
    executor.execute(call("set", key="a", value="1"))
    executor.close()
    assert histories(service) == [([], call("set", key="a", value="1"))]


def test_a_repeat_of_the_call_just_missed_waits_for_its_record_and_hits(service):
    release_record = threading.Event()

    def slow_records(request):
        if request.url.path.endswith("/record"):
            assert release_record.wait(10)
        return service.handle(request)

    get_a, get_b = call("get", key="a"), call("get", key="b")
    with served(slow_records) as url, TVCacheClient(url, "secret") as client:
        executor = ToolCallExecutor(client, TASK, Factory(), rollout_id="r1")
        service.script("lookup", {**miss(replay=[]), "claim": "granted"})
        executor.execute(get_a)
        service.script("lookup", hit({"value": "b"}))
        executor.execute(get_b)  # another call does not wait for the record
        threading.Timer(0.2, release_record.set).start()
        service.script("lookup", hit({"value": None}))
        # Claiming again would grant the rollout its own claim and execute the call twice.
        assert executor.execute(get_a) == {"value": None}
        executor.close()

    assert [seen.route for seen in service.seen] == ["lookup", "lookup", "record", "lookup"]
    assert (executor.hits, executor.executed) == (2, 1)
    assert executor.background_wait_ms > 0.0


def test_the_record_sends_the_result_as_it_was_returned(service, client):
    executor = ToolCallExecutor(client, TASK, Factory())
    service.script("lookup", miss(replay=[]))
    result = executor.execute(call("set", key="a", value="1"))
    result["value"] = "changed by the caller"
    executor.flush()
    assert service.requests("record")[0].body["result"] == {"value": "1"}


def test_a_failed_record_leaves_the_result_and_gives_the_claim_up(service, client, caplog):
    executor = ToolCallExecutor(client, TASK, Factory(), rollout_id="r1")
    set_a = call("set", key="a", value="1")
    service.script("lookup", {**miss(replay=[]), "claim": "granted"})
    service.script("record", {"error": {"code": "env_changed", "message": "changed"}}, status=409)

    with caplog.at_level(logging.WARNING, logger="tvclient"):
        assert executor.execute(set_a) == {"value": "1"}
        executor.flush()

    assert executor.record_failures == 1 and "could not record" in caplog.text
    (released,) = service.requests("release_claim")
    assert released.body == {"history": [], "call": set_a, "rollout_id": "r1"}
    assert executor.history == (set_a,)  # the call ran: the rollout's state includes it


def test_a_failed_snapshot_registration_keeps_the_claim_of_the_recorded_call(service, client):
    executor = ToolCallExecutor(client, TASK, Factory(), rollout_id="r1")
    service.script("lookup", {**miss(replay=[]), "claim": "granted"})
    service.script("record", {"node_id": 5, "created": True, "snapshot": "wanted", "evicted": []})
    service.script("snapshot", {"error": {"code": "unknown_node", "message": "gone"}}, status=404)

    executor.execute(call("set", key="a", value="1"))
    executor.flush()

    assert executor.record_failures == 1
    # Rollouts waiting on the call take the recorded hit: releasing would make them execute it.
    assert service.requests("release_claim") == []
    assert len(executor.snapshots) == 0


def test_a_fork_that_fails_in_the_background_fails_the_next_miss(service, client):
    class BrokenFork(InMemoryEnvironment):
        def fork(self):
            raise RuntimeError("fork failed")

    executor = ToolCallExecutor(client, TASK, BrokenFork, rollout_id="r1")
    set_a, get_a = call("set", key="a", value="1"), call("get", key="a")
    service.script("lookup", miss(replay=[]))
    service.script("record", {"node_id": 5, "created": True, "snapshot": "wanted", "evicted": []})
    executor.execute(set_a)
    service.script("lookup", {**miss(replay=[set_a], matched=1), "claim": "granted"})

    with pytest.raises(RuntimeError, match="fork failed"):
        executor.execute(get_a)

    (released,) = service.requests("release_claim")  # the failed miss's own claim
    assert released.body["call"] == get_a
    assert executor.env is None  # its state is unknown: the next miss rebuilds it


def test_single_flight_needs_a_rollout_id_and_can_be_turned_off(service, client):
    for executor in (
        ToolCallExecutor(client, TASK, Factory()),
        ToolCallExecutor(client, TASK, Factory(), rollout_id="r", single_flight=False),
    ):
        service.script("lookup", hit({"value": "1"}))
        executor.execute(call("get", key="a"))
    assert ["claim" in seen.body for seen in service.requests("lookup")] == [False, False]


def test_miss_without_snapshot_starts_fresh_and_replays_every_write(service, client):
    factory = Factory()
    executor = ToolCallExecutor(client, TASK, factory)
    set_a, get_a, append_a = call("set", key="a", value="1"), call("get", key="a"), call("append", key="a", value="2")
    play_hits(service, executor, [set_a, get_a, append_a])
    service.script("lookup", miss(replay=[set_a, append_a], matched=3))

    assert executor.execute(call("list")) == {"keys": ["a"]}
    executor.flush()

    (env,) = factory.made
    assert env is executor.env and env.data == {"a": "12"}
    assert env.executions == 3
    # Each executed call is recorded after its own prefix of the rollout's history.
    assert histories(service) == [
        ([], set_a),
        ([set_a, get_a], append_a),
        ([set_a, get_a, append_a], call("list")),
    ]
    assert (executor.replayed, executor.executed, executor.misses) == (2, 1, 1)
    assert service.requests("release") == []


def test_miss_resumes_from_local_snapshot_and_replays_only_the_suffix(service, client):
    store = SnapshotStore()
    snapshot = frozen({"a": "1"})  # the state after set_a
    store.add("snap-1", snapshot)
    factory = Factory()
    executor = ToolCallExecutor(client, TASK, factory, snapshots=store)
    set_a = call("set", key="a", value="1")
    append_2, append_3 = call("append", key="a", value="2"), call("append", key="a", value="3")
    play_hits(service, executor, [set_a, append_2, append_3])
    service.script(
        "lookup",
        miss(replay=[set_a, append_2, append_3], resume=resume("snap-1", [append_2, append_3])),
    )

    assert executor.execute(call("get", key="a")) == {"value": "123"}
    executor.flush()

    assert factory.made == []
    assert executor.env.executions == 3  # two replayed appends and the get
    assert snapshot.executions == 0 and snapshot.data == {"a": "1"}
    assert histories(service) == [
        ([set_a], append_2),
        ([set_a, append_2], append_3),
        ([set_a, append_2, append_3], call("get", key="a")),
    ]
    (release,) = service.requests("release")
    assert release.path == "/api/v1/leases/7"
    assert float(release.params["restore_ms"]) >= 0


def test_snapshot_this_process_does_not_hold_means_fresh_start(service, client):
    factory = Factory()
    executor = ToolCallExecutor(client, TASK, factory, snapshots=SnapshotStore())
    set_a = call("set", key="a", value="1")
    play_hits(service, executor, [set_a])
    service.script("lookup", miss(replay=[set_a], resume=resume("other-process", [])))

    assert executor.execute(call("get", key="a")) == {"value": "1"}
    executor.flush()

    assert factory.made[0].executions == 2
    (release,) = service.requests("release")
    assert release.params == {}  # nothing was forked, so no restore time


def test_state_changing_hit_is_applied_to_own_env_before_next_miss(service, client):
    factory = Factory()
    executor = ToolCallExecutor(client, TASK, factory)
    set_x = call("set", key="a", value="x")
    append_y, append_z = call("append", key="a", value="y"), call("append", key="a", value="z")
    service.script("lookup", miss(replay=[]))
    executor.execute(set_x)
    service.script("lookup", hit({"value": "xy"}))
    executor.execute(append_y)
    service.script("lookup", hit({"value": "xy"}))
    executor.execute(call("get", key="a"))  # read-only: nothing to apply later
    service.script("lookup", miss(replay=[set_x, append_y], matched=3))

    assert executor.execute(append_z) == {"value": "xyz"}
    executor.flush()

    (env,) = factory.made
    assert env.executions == 3
    assert histories(service)[1:] == [
        ([set_x], append_y),
        ([set_x, append_y, call("get", key="a")], append_z),
    ]
    assert (executor.hits, executor.misses, executor.replayed, executor.executed) == (2, 2, 1, 2)


@pytest.mark.parametrize("held", [True, False])
def test_lease_is_released_when_execution_fails(service, client, held):
    store = SnapshotStore()
    if held:
        store.add("snap-1", frozen({}))
    factory = Factory()
    executor = ToolCallExecutor(client, TASK, factory, snapshots=store)
    service.script("lookup", miss(replay=[], resume=resume("snap-1", [], lease_id=9)))

    with pytest.raises(UnknownTool):
        executor.execute(call("explode"))

    (release,) = service.requests("release")
    assert release.path == "/api/v1/leases/9"
    assert ("restore_ms" in release.params) is held
    # An environment that raised is in an unknown state: the rollout leaves the shared graph and
    # goes on in it (known-state rule); the failed call is not in the history.
    assert executor.detached and executor.env is not None and executor.history == ()
    assert service.requests("record") == []
    # Its later calls run in that environment, with no lookup and no record.
    lookups = len(service.requests("lookup"))
    assert executor.execute(call("set", key="k", value=1)) is not None
    assert len(service.requests("lookup")) == lookups and service.requests("record") == []
    executor.close()
    assert all(not env.running for env in factory.made)


def test_a_timed_out_call_takes_the_rollout_off_the_shared_graph(service, client):
    class SlowEnv(InMemoryEnvironment):
        def execute(self, call):
            if call["tool"] == "slow":
                self.data["partial"] = True
                return {"timed_out": True}
            return super().execute(call)

    executor = ToolCallExecutor(client, TASK, SlowEnv)
    service.script("lookup", miss(replay=[], resume=None))
    assert executor.execute(call("slow")) == {"timed_out": True}
    assert executor.detached and service.requests("record") == []
    lookups = len(service.requests("lookup"))
    executor.execute(call("get", key="partial"))
    assert len(service.requests("lookup")) == lookups and service.requests("record") == []
    executor.close()


def test_failed_lease_release_does_not_fail_the_call(service, client, caplog):
    executor = ToolCallExecutor(client, TASK, Factory())
    service.script("lookup", miss(replay=[], resume=resume("elsewhere", [], lease_id=5)))
    service.script("release", {"error": {"code": "not_found", "message": "gone"}}, status=404)

    with caplog.at_level(logging.WARNING, logger="tvclient"):
        assert executor.execute(call("set", key="a", value="1")) == {"value": "1"}
        executor.flush()

    assert "lease 5" in caplog.text


def test_wanted_snapshot_is_frozen_registered_and_kept(service, client):
    store = SnapshotStore()
    executor = ToolCallExecutor(client, TASK, Factory(), snapshots=store)
    service.script("lookup", miss(replay=[]))
    service.script("record", {"node_id": 5, "created": True, "snapshot": "wanted", "evicted": []})
    executor.execute(call("set", key="a", value="1"))
    executor.flush()

    (registration,) = service.requests("snapshot")
    assert registration.path == f"/api/v1/tasks/{TASK}/nodes/5/snapshots"
    assert registration.body["backend"] == "external"
    assert registration.body["create_ms"] >= 0
    snapshot = store.get(registration.body["ref"])
    assert snapshot is not None and snapshot is not executor.env

    service.script("lookup", miss(replay=[call("set", key="a", value="1")], matched=1))
    executor.execute(call("append", key="a", value="2"))

    assert snapshot.data == {"a": "1"} and snapshot.executions == 0


def test_evicted_snapshots_are_stopped_and_forgotten(service, client):
    store = SnapshotStore()
    by_record, by_registration = frozen({"a": "1"}), frozen({"a": "2"})
    store.add("old-1", by_record)
    store.add("old-2", by_registration)
    executor = ToolCallExecutor(client, TASK, Factory(), snapshots=store)
    service.script("lookup", miss(replay=[]))
    service.script(
        "record",
        {"node_id": 5, "created": True, "snapshot": "wanted", "evicted": ["old-1", "not-ours"]},
    )
    service.script("snapshot", {"snapshot_id": 8, "ref": "x", "evicted": ["old-2"]}, status=201)

    executor.execute(call("set", key="a", value="3"))
    executor.flush()

    assert not by_record.running and not by_registration.running
    assert "old-1" not in store and "old-2" not in store
    assert len(store) == 1  # only the snapshot just taken


def test_close_stops_own_env_and_private_snapshots_but_not_shared_ones(service, client):
    shared = SnapshotStore()
    factory = Factory()
    wanted = {"node_id": 5, "created": True, "snapshot": "wanted", "evicted": []}
    with (
        ToolCallExecutor(client, TASK, factory, snapshots=shared) as sharing,
        ToolCallExecutor(client, TASK, factory) as private,
    ):
        for executor in (sharing, private):
            service.script("lookup", miss(replay=[]))
            service.script("record", wanted)
            executor.execute(call("set", key="a", value="1"))
            executor.flush()
        kept_private = private.snapshots.get(service.requests("snapshot")[1].body["ref"])

    assert all(not env.running for env in factory.made)
    assert not kept_private.running
    assert len(shared) == 1 and shared.get(service.requests("snapshot")[0].body["ref"]).running


def test_a_service_answer_that_makes_no_sense_runs_the_rollout_uncached(service, client, caplog):
    # Before, the executor raised the service's bad answer into the trajectory; tvcache's own
    # failures must never show there, so the rollout now goes on uncached.
    factory = Factory({"a": "1"})
    executor = ToolCallExecutor(client, TASK, factory)
    service.script("lookup", miss(replay=[call("set", key="never", value="sent")]))

    with caplog.at_level(logging.WARNING, logger="tvclient.executor"):
        assert executor.execute(call("get", key="a")) == {"value": "1"}
        assert executor.execute(call("set", key="b", value="2")) == {"value": "2"}

    assert executor.offline and executor.detached
    assert service.requests("record") == [] and len(service.requests("lookup")) == 1
    assert sum("goes on uncached" in record.message for record in caplog.records) == 1


def test_async_executor_runs_the_same_protocol(service):
    factory = Factory()
    set_a = call("set", key="a", value="1")
    service.script("lookup", hit({"value": "1"}))
    service.script("lookup", miss(replay=[set_a], matched=1))

    async def rollout():
        with served(service.handle) as url, TVCacheClient(url, "secret") as client:
            async with AsyncToolCallExecutor(client, TASK, factory) as executor:
                first = await executor.execute(set_a)
                second = await executor.execute(call("get", key="a"))
                return first, second, executor.executor.hits

    assert asyncio.run(rollout()) == ({"value": "1"}, {"value": "1"}, 1)
    assert factory.made[0].executions == 2 and not factory.made[0].running


def test_snapshot_another_rollout_registered_first_is_dropped_and_the_call_succeeds(service, client):
    store = SnapshotStore()
    executor = ToolCallExecutor(client, TASK, Factory(), snapshots=store)
    service.script("lookup", miss(replay=[]))
    service.script("record", {"node_id": 5, "created": False, "snapshot": "wanted", "evicted": []})
    service.script("snapshot", {"error": {"code": "snapshot_exists", "message": "taken", "details": None}}, status=409)
    assert executor.execute(call("set", key="a", value="1")) is not None
    executor.flush()  # the registration is answered in the background
    assert len(store) == 0


def audited_hit(result, *, mutates: bool, node_id: int = 1):
    return {**hit(result, node_id=node_id), "mutates": mutates, "audit": True}


def test_a_sampled_read_only_hit_is_re_executed_in_the_open_environment_and_reported(service, client):
    factory = Factory()
    executor = ToolCallExecutor(client, TASK, factory, rollout_id="r1")
    set_a, get_a = call("set", key="a", value="1"), call("get", key="a")
    service.script("lookup", miss(replay=[]))
    executor.execute(set_a)  # opens the environment
    service.script("lookup", audited_hit({"value": "1"}, mutates=False, node_id=5))
    service.script("audit", {"divergent": False})
    assert executor.execute(get_a) == {"value": "1"}
    service.script("lookup", audited_hit({"value": "stale"}, mutates=False, node_id=6))
    service.script("audit", {"divergent": True})
    assert executor.execute(get_a) == {"value": "stale"}  # the hit's answer; the service stops serving it

    reports = service.requests("audit")
    assert [seen.path for seen in reports] == [
        f"/api/v1/tasks/{TASK}/nodes/5/audit",
        f"/api/v1/tasks/{TASK}/nodes/6/audit",
    ]
    assert reports[0].body == {"result": {"value": "1"}, "rollout_id": "r1"}
    assert (executor.audited, executor.divergent, executor.audits_skipped) == (2, 1, 0)
    (env,) = factory.made
    assert env.executions == 3 and executor.env is env  # read-only: the environment stays


def test_sampled_hits_are_not_audited_where_the_environment_is_not_at_their_state(service, client):
    factory = Factory()
    executor = ToolCallExecutor(client, TASK, factory, rollout_id="r1")
    set_a, append_b = call("set", key="a", value="1"), call("append", key="a", value="b")
    service.script("lookup", audited_hit({"value": "1"}, mutates=False))
    executor.execute(call("get", key="a"))  # no environment yet
    service.script("lookup", miss(replay=[]))
    executor.execute(set_a)
    service.script("lookup", audited_hit({"value": "1b"}, mutates=True))
    executor.execute(append_b)  # changes the state: re-executing it would need a fork at its parent state
    service.script("lookup", audited_hit({"value": "1b"}, mutates=False))
    executor.execute(call("get", key="a"))  # the environment is behind by the append

    assert service.requests("audit") == []
    assert (executor.audited, executor.audits_skipped) == (0, 3)
    assert factory.made[0].executions == 1


def test_an_audited_call_that_changed_the_environment_drops_it(service, client):
    factory = Factory()
    executor = ToolCallExecutor(client, TASK, factory, rollout_id="r1")
    service.script("lookup", miss(replay=[]))
    executor.execute(call("set", key="a", value="1"))
    # The service holds the set of b as read-only (observed to change nothing elsewhere); here it
    # changes the environment, which is then ahead of the history.
    service.script("lookup", audited_hit({"value": "2"}, mutates=False))
    service.script("audit", {"divergent": False})
    executor.execute(call("set", key="b", value="2"))
    assert executor.env is None and factory.made[0].running is False
    assert executor.audited == 1


def test_an_audit_the_service_cannot_take_leaves_the_hit(service, client, caplog):
    executor = ToolCallExecutor(client, TASK, Factory(), rollout_id="r1")
    service.script("lookup", miss(replay=[]))
    executor.execute(call("set", key="a", value="1"))
    service.script("lookup", audited_hit({"value": "1"}, mutates=False))
    service.script("audit", {"error": {"code": "unknown_node", "message": "gone", "details": None}}, status=404)
    assert executor.execute(call("get", key="a")) == {"value": "1"}
    assert executor.record_failures == 1 and executor.audited == 0
    assert "could not report the audit" in caplog.text


def test_a_result_that_is_not_exact_json_runs_uncached_and_a_write_detaches(service, client, caplog):
    class Odd(InMemoryEnvironment):
        def execute(self, call):
            if call["tool"] == "pair":  # a tuple would come back from the cache as a list
                self.data["p"] = "x"
                return {"pair": ("a", 1)}
            if call["tool"] == "keys":  # int keys would come back as str keys
                return {1: "one"}
            return super().execute(call)

        def mutates_state(self, call):
            return call["tool"] != "keys"

    # A task of its own: the warning is logged once per task and tool in a process.
    executor = ToolCallExecutor(client, "odd-results", lambda: Odd({"a": "1"}), rollout_id="r1")
    service.script("lookup", {**miss(replay=[]), "claim": "granted"})
    service.script("lookup", {**miss(replay=[]), "claim": "granted"})
    with caplog.at_level(logging.WARNING, logger="tvclient.executor"):
        assert executor.execute(call("keys")) == {1: "one"}
        assert not executor.detached  # read-only: the rollout stays on the graph
        assert executor.execute(call("pair")) == {"pair": ("a", 1)}
        assert executor.detached  # it may have changed the state, which no node describes
        assert executor.execute(call("get", key="p")) == {"value": "x"}

    executor.close()
    assert executor.uncacheable == 2
    assert service.requests("record") == []
    assert len(service.requests("lookup")) == 2 and len(service.requests("release_claim")) == 2
    assert sum("ran uncached" in record.message for record in caplog.records) == 2


def test_a_call_with_arguments_that_are_not_exact_json_runs_uncached(service, client):
    factory = Factory({"a": "1"})
    executor = ToolCallExecutor(client, TASK, factory)
    service.script("lookup", hit({"ok": True}))
    executor.execute(call("set", key="a", value="2"))

    class Name(str):  # would come back from the cache as a plain str
        pass

    assert executor.execute({"tool": "get", "args": {"key": Name("a")}}) == {"value": "2"}
    assert executor.uncacheable == 1 and factory.made[0].data["a"] == "2"  # the hit was replayed first
    assert len(service.requests("lookup")) == 1


def test_load_shed_is_retried_after_the_time_it_asks_for(service, client):
    service.script("lookup", {"error": {"code": "overloaded", "message": "later"}}, status=503)
    service.script("lookup", hit({"value": "cached"}))
    executor = ToolCallExecutor(client, TASK, Factory())

    assert executor.execute(call("get", key="a")) == {"value": "cached"}
    assert not executor.offline and len(service.requests("lookup")) == 2


def test_a_rollout_started_while_the_service_is_down_runs_uncached_from_its_start(caplog):
    from tvclient import RetryPolicy

    factory = Factory({"a": "1"})
    with TVCacheClient("http://127.0.0.1:9", "secret", retry=RetryPolicy(budget_s=0.1)) as down:
        executor = ToolCallExecutor(down, TASK, factory, rollout_id="r1")
        with caplog.at_level(logging.WARNING, logger="tvclient.executor"):
            assert executor.execute(call("set", key="a", value="2")) == {"value": "2"}
            assert executor.execute(call("get", key="a")) == {"value": "2"}
        executor.close()
    assert executor.offline and executor.executed == 2 and len(factory.made) == 1
    assert sum("goes on uncached" in record.message for record in caplog.records) == 1


def test_an_outage_mid_rollout_replays_the_hits_and_goes_on_uncached(service, client):
    factory = Factory({"a": "1"})
    executor = ToolCallExecutor(client, TASK, factory, rollout_id="r1")
    service.script("lookup", hit({"value": "2"}))
    executor.execute(call("set", key="a", value="2"))  # a hit: nothing ran
    service.script("lookup", {"error": {"code": "boom", "message": "down"}}, status=500)
    service.script("lookup", {"error": {"code": "boom", "message": "down"}}, status=500)
    service.script("lookup", {"error": {"code": "boom", "message": "down"}}, status=500)

    assert executor.execute(call("append", key="a", value="3")) == {"value": "23"}
    assert executor.execute(call("get", key="a")) == {"value": "23"}
    assert executor.offline and executor.replayed == 1 and service.requests("record") == []


class Serving(InMemoryEnvironment):
    """Keys named server:* stand for processes a call left running (a server, a daemon); its forks
    copy the keys only, as a filesystem snapshot copies files."""

    def live_processes(self):
        return [key for key in self.data if key.startswith("server:")]


def test_a_state_with_live_processes_is_not_snapshotted_when_forks_would_lose_them(service, client):
    forks: list[InMemoryEnvironment] = []

    class Forking(Serving):
        def fork(self) -> InMemoryEnvironment:
            forks.append(super().fork())
            return forks[-1]

    store = SnapshotStore()
    executor = ToolCallExecutor(client, TASK, Forking, snapshots=store)
    start, note = call("set", key="server:http", value="8080"), call("set", key="notes", value="x")
    service.script("lookup", miss(replay=[], snapshot_after_ms=0.0))  # likely wanted: not frozen ahead either
    service.script("record", {"node_id": 5, "created": True, "snapshot": "wanted", "evicted": []})
    executor.execute(start)
    executor.flush()
    assert forks == [] and service.requests("snapshot") == [] and len(store) == 0
    # A state without processes is snapshotted as before.
    plain = ToolCallExecutor(client, TASK, Forking, snapshots=store)
    service.script("lookup", miss(replay=[]))
    service.script("record", {"node_id": 6, "created": True, "snapshot": "wanted", "evicted": []})
    plain.execute(note)
    plain.close()
    executor.close()
    (registration,) = service.requests("snapshot")
    assert registration.path.endswith("/nodes/6/snapshots") and len(forks) == 1

    class Checkpointing(Serving):  # its forks keep processes: its snapshots stand in for such a state
        keeps_processes = True

    kept = ToolCallExecutor(client, TASK, Checkpointing, snapshots=store)
    service.script("lookup", miss(replay=[]))
    service.script("record", {"node_id": 7, "created": True, "snapshot": "wanted", "evicted": []})
    kept.execute(start)
    kept.close()
    checkpoint = service.requests("snapshot")[-1]
    assert checkpoint.path.endswith("/nodes/7/snapshots")
    assert store.get(checkpoint.body["ref"]).data == {"server:http": "8080"}
