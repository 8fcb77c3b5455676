"""tvcache down never changes a trajectory: a served tvcache (uvicorn, PostgreSQL) is killed in
the middle of an episode and brought back. The episode goes on uncached with the observations
of an uncached run; rollouts started while it is down run uncached from their start; a short
outage inside the retry budget is ridden out; once it is back, new rollouts use it again."""

import uuid

import pytest

from accounts.services.tokens import token_create
from lab.server import service_running
from tvclient import InMemoryEnvironment, RetryPolicy, SnapshotStore, ToolCallExecutor, TVCacheClient

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

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
    return ToolCallExecutor(client, "outage", InMemoryEnvironment, rollout_id=rollout_id, epoch=0, snapshots=snapshots)


def test_an_episode_through_an_outage_sees_what_an_uncached_run_sees(settings):
    expected, snapshots = uncached(), SnapshotStore()
    with service_running(db=settings.DATABASES["default"], redis_url="", workers=1) as service:
        token = token_create(name="outage")
        # A short budget: the outage below outlasts it.
        with TVCacheClient(service.url, token, retry=RetryPolicy(budget_s=1.0, probe_s=0.0)) as client:
            client.put_task(
                "outage",
                env={"backend": "external", "kv": 1},
                tools={"get": {"mutates_state": False}, "list": {"mutates_state": False}},
                sandbox_budget=4,
            )
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


def test_a_skyrl_episode_through_an_outage_sees_what_an_uncached_episode_sees(settings):
    """The same through a framework: skyrl-gym's make/init/step with NotesEnv (lab driver)."""
    import skyrl_gym
    from omegaconf import OmegaConf

    from lab.frameworks.skyrl_rollouts import NotesEnv, _act
    from tvclient.integrations.skyrl import tvcache_env

    actions = [
        _act("append", "a", "x"),
        _act("read", "a"),
        _act("append", "a", "y"),
        _act("keys"),
        _act("read", "a"),
        "<done/>",
    ]

    def episode(env_id: str, *, before_step=None) -> tuple[list[str], object]:
        env = skyrl_gym.make(env_id, env_config=OmegaConf.create({}), extras={"instance_id": "outage", "max_turns": 9})
        seen = [repr(env.init([{"role": "user", "content": "go"}]))]
        for index, action in enumerate(actions):
            if before_step is not None:
                before_step(index)
            seen.append(repr(env.step(action)))
        seen.append(repr(env.get_metrics()))
        env.close()
        return seen, env

    suffix = uuid.uuid4().hex[:8]
    skyrl_gym.register(id=f"notes-plain-{suffix}", entry_point=NotesEnv)
    expected, _ = episode(f"notes-plain-{suffix}")
    with service_running(db=settings.DATABASES["default"], redis_url="", workers=1) as service:
        # Every request probes once while the service is marked down: the rollout after the
        # outage finds it back at once.
        client = TVCacheClient(
            service.url, token_create(name="outage-skyrl"), retry=RetryPolicy(budget_s=1.0, probe_s=0.0)
        )
        cached_id = f"notes-cached-{suffix}"
        skyrl_gym.register(id=cached_id, entry_point=tvcache_env(NotesEnv, client=client, read_only=("read", "keys")))
        warm, _ = episode(cached_id)

        def outage_at_step_two(index: int) -> None:
            if index == 2:
                service.outage_begin()

        try:
            through, env = episode(cached_id, before_step=outage_at_step_two)
        finally:
            service.outage_end()
        after, env_after = episode(cached_id)
        client.close()
    assert warm == through == after == expected
    assert env.tvcache.offline and env.tvcache.hits == 2
    assert not env_after.tvcache.offline and env_after.tvcache.hits == len(actions) - 1
