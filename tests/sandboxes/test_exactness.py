"""Exact under the real world: timeouts, kills, tampering, a killed server and sandboxes
that do not reach their recorded state never produce a wrong hit. Real Docker, real PostgreSQL."""

from __future__ import annotations

import os
import time

import pytest

from cache import inputs
from cache.models import Divergence, Node, Rollout
from sandboxes.backends import hostfs
from sandboxes.handles import sandbox_config
from sandboxes.models import Sandbox
from sandboxes.services.reserved import settle
from tests.support.toolserver import bash, run

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

# The same call for every rollout; it takes 0 or 3 s at random, and times out after 1 s.
SLOW_OR_NOT = bash("echo a > /f; sleep $((RANDOM % 2 * 3)); echo b >> /f", timeout_s=1)


def test_a_timed_out_call_never_files_later_results_under_the_completed_state(api, docker_task):
    # Tried until the first rollout's call times out (the case that poisoned the key): then its
    # `cat /f` (file holds "a") was recorded under the completed call's state key ("a b").
    for attempt in range(10):
        task = docker_task(f"timeouts-{attempt}")
        first = run(api, task, "r0", SLOW_OR_NOT)
        if first["result"]["timed_out"]:
            break
    else:
        pytest.fail("the first call never timed out in 10 tries")
    outcomes = {"r0": first}
    for rollout in [f"r{i}" for i in range(1, 12)]:
        outcomes[rollout] = run(api, task, rollout, SLOW_OR_NOT)
    wrong, shared = 0, 0
    for rollout, outcome in outcomes.items():
        read = run(api, task, rollout, bash("cat /f"))
        expected = "a\n" if outcome["result"]["timed_out"] else "a\nb\n"
        wrong += read["result"]["stdout"] != expected
        shared += read["cached"]
    assert wrong == 0
    assert shared > 0  # completed rollouts still share hits
    assert Rollout.objects.get(task_id=task, rollout_id="r0").detached_at is not None
    # The timed-out rollout goes on in its own sandbox, uncached and unrecorded.
    nodes = Node.objects.filter(task_id=task).count()
    assert run(api, task, "r0", bash("echo c >> /f; cat /f"))["result"]["stdout"] == "a\nc\n"
    assert Node.objects.filter(task_id=task).count() == nodes


def test_a_replay_that_does_not_reach_the_recorded_state_is_a_divergence_and_never_recorded(api, docker_task):
    grow = bash("head -c $((RANDOM % 1000 + 1)) /dev/zero > /blob")  # a nondeterministic write
    size = bash("wc -c < /blob")
    for attempt in range(5):  # until the replay draws another size than the recorded one (999 in 1,000)
        task = docker_task(f"diverges-{attempt}")
        run(api, task, "r1", grow)
        recorded = run(api, task, "r1", size)["result"]["stdout"]
        assert run(api, task, "r2", grow)["cached"] is True  # r2 has no sandbox yet
        # r2's next call is a miss: its sandbox is rebuilt by a replay, which writes another size.
        answer = run(api, task, "r2", bash("wc -c < /blob; echo seen"))
        if answer["result"]["stdout"].split("\n")[0] + "\n" != recorded:
            break
    assert answer["cached"] is False and answer["node_id"] is None
    divergences = Divergence.objects.filter(task_id=task, kind=Divergence.Kind.STATE)
    assert divergences.count() >= 1 and divergences.first().tool == "bash"
    assert Rollout.objects.get(task_id=task, rollout_id="r2").detached_at is not None
    # Another rollout on the same path never sees r2's result, and r1's state is served as before.
    assert run(api, task, "r3", grow)["cached"] is True
    assert run(api, task, "r3", size)["result"]["stdout"] == recorded
    stats = api.get(f"/api/v1/tasks/{task}/stats").json()
    assert [t["state"] for t in stats["divergences"]["per_tool"] if t["tool"] == "bash"][0] >= 1


# A build cache keyed on whole-second modification times, as Python's .pyc check is: the cached
# copy is reused while the source's time, in seconds, is the one it was made from.
WRITE_V1, WRITE_V2 = bash("echo v1 > /src"), bash("echo v2 > /src")  # the same size
BUILD = bash(
    '[ "$(cat /built.at 2>/dev/null)" = "$(stat -c %Y /src)" ] '
    "|| { cp /src /built; stat -c %Y /src > /built.at; }; cat /built"
)


def test_a_replay_carries_the_file_times_of_the_live_run(api, docker_task):
    # Live, the two writes land seconds apart and the second build sees v2. A replay runs the
    # same calls back to back, within one second: with the replay's own times the build cache
    # served v1. The replay writes back the times each call left when it ran live.
    for attempt in range(3):  # a replay that happens to cross a second boundary hides the defect
        task = docker_task(f"file-times-{attempt}", sandbox_budget=0)  # no snapshots: catch-up replays
        run(api, task, "r1", WRITE_V1)
        assert run(api, task, "r1", BUILD)["result"]["stdout"] == "v1\n"
        time.sleep(1.1)
        run(api, task, "r1", WRITE_V2)
        assert run(api, task, "r1", BUILD)["result"]["stdout"] == "v2\n"
        for call in (WRITE_V1, BUILD, WRITE_V2):
            assert run(api, task, "r2", call)["cached"] is True  # r2 has no sandbox yet
        answer = run(api, task, "r2", bash(BUILD["args"]["command"] + "; echo built"))
        assert answer["cached"] is False
        assert answer["result"]["stdout"] == "v2\nbuilt\n"
        assert not Divergence.objects.filter(task_id=task).exists()


BIG = bash("mkdir -p /w/m && : > /w/obj && cd /w/m && i=0; while [ $i -le 50 ]; do : > f$i; i=$((i+1)); done")
EDIT = bash("echo new > /w/src")
CHECK = "[ /w/src -nt /w/obj ] && echo rebuild || echo up-to-date"  # busybox: whole seconds


@pytest.fixture
def few_file_times():
    """A node keeps the times of at most 20 entries. The backends take the limit from the cached
    configuration: rebuilt with the real limit once the test's background work has ended and the
    limit is back, so that no later test of this process sees 20."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(inputs, "MAX_FILE_TIMES", 20)
        sandbox_config.cache_clear()
        try:
            yield
        finally:
            settle()  # (the autouse _background_snapshots_settled asserts that it ended)
    sandbox_config.cache_clear()


def test_a_replay_that_cannot_restore_every_time_is_verified_and_never_recorded(api, docker_task, few_file_times):
    # BIG changes more entries than a node keeps times of (the limit lowered: few_file_times). The
    # replay restores no time from there on (restoring EDIT's live time after BIG's replayed one put
    # the source behind the object: an order no live run has); BIG and EDIT then land in one second,
    # and the check of the times' order (by whole second too) finds the state is not the live one.
    task = docker_task("holes", sandbox_budget=0)  # no snapshots: r2 catches up by replay
    run(api, task, "r1", BIG)
    time.sleep(1.1)
    run(api, task, "r1", EDIT)
    assert run(api, task, "r1", bash(CHECK))["result"]["stdout"] == "rebuild\n"
    kept = dict(Node.objects.filter(task_id=task, mutates=True).values_list("call__args__command", "file_times"))
    assert kept[BIG["args"]["command"]] is None and kept[EDIT["args"]["command"]]
    assert run(api, task, "r2", BIG)["cached"] and run(api, task, "r2", EDIT)["cached"]
    nodes = Node.objects.filter(task_id=task).count()
    answer = run(api, task, "r2", bash(CHECK + "; echo again"))
    assert answer["cached"] is False and answer["node_id"] is None  # answered uncached, never recorded
    assert Node.objects.filter(task_id=task).count() == nodes
    assert Divergence.objects.filter(task_id=task, kind=Divergence.Kind.STATE).exists()
    assert run(api, task, "r3", BIG)["cached"] and run(api, task, "r3", EDIT)["cached"]
    served = run(api, task, "r3", bash(CHECK))  # r1's recorded answer, never r2's
    assert served["cached"] is True and served["result"]["stdout"] == "rebuild\n"


def test_a_call_that_leaves_a_name_that_is_not_utf8_is_recorded_and_served(api, docker_task):
    task = docker_task("names")
    write = bash("touch \"/w-$(printf '\\377')\" && echo made")
    first = run(api, task, "r1", write)
    assert first["result"]["stdout"] == "made\n" and first["node_id"] is not None
    kept = Node.objects.get(pk=first["node_id"]).file_times
    assert [hostfs.time_path(path) for path in kept] == [os.fsdecode(b"w-\xff")]  # its bytes, as Latin-1 text
    assert run(api, task, "r2", write)["cached"] is True


def test_a_sandbox_cut_off_mid_call_is_retired_not_trusted(api, docker_task, busybox):
    # A server killed between running a call and storing its outcome left the mark: the sandbox may
    # be ahead of the history (here: a file the history never wrote).
    task = docker_task("cut-off")
    run(api, task, "r", bash("echo 1 > /state"))
    row = Sandbox.objects.get(rollout__rollout_id="r", state="leased")
    exec_id = busybox.api.exec_create(row.ref, ["sh", "-c", "echo ahead > /extra"])["Id"]
    busybox.api.exec_start(exec_id)
    Sandbox.objects.filter(pk=row.pk).update(executing=True)
    answer = run(api, task, "r", bash("cat /state; cat /extra 2>&1"))
    assert answer["result"]["stdout"].startswith("1\n") and "ahead" not in answer["result"]["stdout"]
    assert Sandbox.objects.get(pk=row.pk).state == "failed"


def test_the_mark_is_committed_while_the_call_runs_and_cleared_once_it_is_recorded(api, docker_task):
    """Another connection sees the rollout's sandbox marked `executing` while its call runs, on the
    first miss (a sandbox started for it) and on the next ones (its own, read and marked in one
    statement): a server killed then leaves the mark, and the sandbox is retired."""
    import threading

    from django.db import connections

    task = docker_task("marked")
    for step in range(3):
        done = threading.Event()
        answered = {}

        def call(step=step):
            try:
                answered["outcome"] = run(api, task, "r", bash(f"sleep 1; echo {step} >> /f"))
            finally:
                connections.close_all()
                done.set()

        threading.Thread(target=call).start()
        seen = False
        while not done.wait(0.05):
            seen = seen or Sandbox.objects.filter(rollout__rollout_id="r", state="leased", executing=True).exists()
        assert seen and answered["outcome"]["cached"] is False
        row = Sandbox.objects.get(rollout__rollout_id="r", state="leased")
        assert (row.executing, row.applied) == (False, step + 1)


def test_a_call_that_kills_what_runs_it_leaves_the_rollout_going_in_its_own_sandbox(api, docker_task):
    # The call kills the shell of the session agent that waits for it: its exit status is lost, so its
    # effects are unknown. The rollout leaves the graph, and goes on in its own sandbox, as it would
    # without tvcache (which has no such shell); nothing is recorded from it.
    task = docker_task("agent-killed")
    run(api, task, "r", bash("echo kept > /f"))
    nodes = Node.objects.filter(task_id=task).count()
    response = api.post(
        f"/api/v1/tasks/{task}/rollouts/r/calls", {"call": bash("echo more >> /f; kill -9 $PPID")}, format="json"
    )
    assert response.status_code == 409 and response.json()["error"]["code"] == "session_broken"
    assert run(api, task, "r", bash("cat /f"))["result"]["stdout"] == "kept\nmore\n"
    assert Rollout.objects.get(task_id=task, rollout_id="r").detached_at is not None
    assert Node.objects.filter(task_id=task).count() == nodes
