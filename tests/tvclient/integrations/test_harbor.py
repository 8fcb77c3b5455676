"""Harbor: trials of a task as Harbor runs them (start, agent setup uploads, commands, the
verifier's upload, test run and download, stop), against a served tvcache. Harbor needs Python
3.12: on this machine's 3.11 its BaseEnvironment is the stand-in of harbor_standin.py, with
Harbor's signatures and a real shell in a folder; with Harbor installed, the real one is used."""

import asyncio
import logging
import uuid

import pytest

from . import frameworks

frameworks.load_harbor()

from harbor.environments.base import ExecResult  # noqa: E402

from tvclient.integrations import harbor as integration  # noqa: E402
from tvclient.integrations.harbor import cached  # noqa: E402

from .harbor_standin import LocalEnvironment  # noqa: E402


@pytest.fixture
def environment_dir(tmp_path):
    directory = tmp_path / f"env-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    (directory / "Dockerfile").write_text("FROM debian\n")
    return directory


@pytest.fixture
def cached_class(tvcache):
    return type("Trial", (cached(LocalEnvironment),), {"tvcache_client": tvcache})


def write(path, text, mode=0o644):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


async def trial(environment_class, environment_dir, tmp_path, *, agent_commands, test_script):
    """What a Harbor trial does with its environment."""
    session = f"task__{uuid.uuid4().hex[:7]}__env"
    environment = environment_class(environment_dir=environment_dir, environment_name="task",
                                    session_id=session, trial_paths=None, task_env_config=None,
                                    logger=logging.getLogger("trial"), persistent_env={"LANG": "C"})
    await environment.start(force_build=False)
    outputs = []
    try:
        # The agent's setup uploads its installer from a folder of its own, then runs it.
        installer = write(tmp_path / uuid.uuid4().hex / "install.sh", "echo installed > tool.txt\n", 0o755)
        await environment.upload_file(installer, "/installed/install.sh")
        outputs.append((await environment.exec("sh installed/install.sh", user="agent")).return_code)
        for command in agent_commands:
            result = await environment.exec(command, env={"GREETING": "hi"}, timeout_sec=30)
            assert isinstance(result, ExecResult)
            outputs.append(result.stdout)
        # The verifier uploads the tests (a fresh copy each trial), runs them, downloads the logs.
        tests = tmp_path / uuid.uuid4().hex
        write(tests / "test.sh", test_script, 0o755)
        write(tests / "data" / "expected.txt", "a\n")
        await environment.upload_dir(tests, "/tests")
        outputs.append((await environment.exec("sh tests/test.sh")).stdout)
        assert await environment.is_file("logs/reward.txt")
        reward = tmp_path / f"reward-{uuid.uuid4().hex}.txt"
        await environment.download_file("/logs/reward.txt", reward)
        outputs.append(reward.read_text())
    finally:
        await environment.stop(delete=True)
    return outputs


TEST = "mkdir -p logs; if cmp -s notes.txt tests/data/expected.txt; then echo 1 > logs/reward.txt; " \
       "else echo 0 > logs/reward.txt; fi; cat notes.txt\n"


@pytest.mark.django_db(transaction=True)
def test_trials_of_a_task_hit_each_other_and_downloads_see_the_real_state(cached_class, environment_dir, tmp_path,
                                                                        tvcache):
    LocalEnvironment.commands.clear()
    commands = ["echo a >> notes.txt", "echo $GREETING $LANG"]
    first = asyncio.run(trial(cached_class, environment_dir, tmp_path, agent_commands=commands, test_script=TEST))
    assert first == [0, "", "hi C\n", "a\n", "1\n"]
    ran = len(LocalEnvironment.commands)

    second = asyncio.run(trial(cached_class, environment_dir, tmp_path, agent_commands=commands, test_script=TEST))
    assert second == first
    # Every command and upload hit; the download ran in the trial's own sandbox, which first
    # replayed the cached history (the installer, the agent's commands, the tests) to reach it.
    replayed = LocalEnvironment.commands[ran:]
    assert replayed == ["mkdir -p logs", "sh installed/install.sh", *commands, "sh tests/test.sh"]

    # Another history: the second write is a miss, and the tests and the reward see it.
    third = asyncio.run(trial(cached_class, environment_dir, tmp_path,
                              agent_commands=[commands[0], "echo b >> notes.txt"], test_script=TEST))
    assert third == [0, "", "", "a\nb\n", "0\n"]
    task_id = f"task-{_definition(environment_dir)[:12]}"
    assert tvcache.stats(task_id)["hits"] >= 7


@pytest.mark.django_db(transaction=True)
def test_uploads_are_keyed_by_content_and_a_timeout_raises_as_harbor_does(cached_class, environment_dir, tmp_path):
    other_test = TEST.replace("echo 1", "echo 2")
    first = asyncio.run(trial(cached_class, environment_dir, tmp_path, agent_commands=["echo a >> notes.txt"],
                              test_script=TEST))
    second = asyncio.run(trial(cached_class, environment_dir, tmp_path, agent_commands=["echo a >> notes.txt"],
                               test_script=other_test))
    assert (first[-1], second[-1]) == ("1\n", "2\n")  # other tests, other content: not the cached run

    async def timeout():
        environment = cached_class(environment_dir=environment_dir, environment_name="task",
                                   session_id="task__timeout__env", trial_paths=None, task_env_config=None)
        await environment.start(force_build=False)
        try:
            await environment.exec("echo a >> notes.txt")
            with pytest.raises(RuntimeError, match="timed out"):
                await environment.exec("sleep 5", timeout_sec=1)
            # The sandbox's state after a timeout is unknown: what follows still sees the
            # rollout's own history (the executor's known-state rule decides how).
            assert (await environment.exec("cat notes.txt")).stdout == "a\n"
        finally:
            await environment.stop(delete=True)

    asyncio.run(timeout())


def test_import_path_names_a_cached_class_of_each_environment_type():
    """`environment.import_path: tvclient.integrations.harbor:CachedDocker`, as Harbor's
    import_class resolves it (module attribute, a BaseEnvironment subclass)."""
    from harbor.environments.base import BaseEnvironment

    environment_class = integration.CachedDocker
    assert issubclass(environment_class, BaseEnvironment)
    assert issubclass(environment_class, integration.TVCacheEnvironment)
    assert integration.CachedDocker is environment_class
    with pytest.raises(AttributeError):
        integration.CachedNothing


def _definition(environment_dir):
    return integration._definition(LocalEnvironment(environment_dir, "task", "s", None, None))
