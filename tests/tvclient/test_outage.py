"""tvcache down never changes a trajectory: a served tvcache (uvicorn, PostgreSQL) is killed in
the middle of an episode and brought back. The episode goes on uncached with the observations
of an uncached run; rollouts started while it is down run uncached from their start; a short
outage inside the retry budget is ridden out; once it is back, new rollouts use it again."""

import pytest
from tvclient import InMemoryEnvironment, RetryPolicy, SnapshotStore, TVCacheClient, ToolCallExecutor

from cache.api.auth import token_create
from lab.server import service_running

pytestmark = pytest.mark.django_db(transaction=True)

CALLS = [
    {"tool": "set", "args": {"key": "a", "value": "1"}},
    {"tool": "append", "args": {"key": "a", "value": "2"}},
    {"tool": "get", "args": {"key": "a"}},
    {"tool": "set", "args": {"key": "b", "value": "x"}},
    {"tool": "append", "args": {"key": "a", "value": "3"}},
    {"tool": "list", "args": {}},
    {"tool": "get", "args": {"key": "a"}},
]


def uncached() -> list[dict]:
    env = InMemoryEnvironment()
    env.start()
    return [env.execute(call) for call in CALLS]


def executor(client, rollout_id, snapshots) -> ToolCallExecutor:
    return ToolCallExecutor(client, "outage", InMemoryEnvironment, rollout_id=rollout_id, epoch=0,
                            snapshots=snapshots)


def test_an_episode_through_an_outage_sees_what_an_uncached_run_sees(settings):
    expected, snapshots = uncached(), SnapshotStore()
    with service_running(db=settings.DATABASES["default"], redis_url="", workers=1) as service:
        token = token_create(name="outage")
        # A short budget: the outage below outlasts it.
        with TVCacheClient(service.url, token, retry=RetryPolicy(budget_s=1.0, down_s=0.5)) as client:
            client.put_task("outage", env={"backend": "external", "kv": 1},
                            tools={"get": {"mutates_state": False}, "list": {"mutates_state": False}},
                            sandbox_budget=4)
            with executor(client, "warm", snapshots) as warm:
                assert [warm.execute(call) for call in CALLS] == expected

            episode = executor(client, "episode", snapshots)
            seen = [episode.execute(call) for call in CALLS[:3]]
            assert episode.hits == 3 and episode.executed == 0
            service.outage_begin()
            try:
                seen += [episode.execute(call) for call in CALLS[3:]]
                episode.close()
                assert seen == expected
                assert episode.offline and episode.replayed == 2  # the two writes it had hit
                started_down = executor(client, "started-down", snapshots)
                with started_down:
                    assert [started_down.execute(call) for call in CALLS] == expected
                assert started_down.offline and started_down.hits == 0
            finally:
                service.outage_end()

            with executor(client, "after", snapshots) as after:
                assert [after.execute(call) for call in CALLS] == expected
            assert not after.offline and after.hits == len(CALLS)

        # A restart inside the budget: the requests are retried until it answers again.
        with TVCacheClient(service.url, token, retry=RetryPolicy(budget_s=60.0)) as patient:
            ridden = executor(patient, "ridden", snapshots)
            seen = [ridden.execute(call) for call in CALLS[:2]]
            service.restart()
            seen += [ridden.execute(call) for call in CALLS[2:]]
            ridden.close()
            assert seen == expected and not ridden.offline and ridden.hits == len(CALLS)
    snapshots.close()
