"""Property tests of tool-server mode against the real store (PostgreSQL, the directory backend).

Hypothesis drives random rollouts of a directory task through POST .../rollouts/{r}/calls, with
faults injected into the service's own sandboxes: a call that times out or fails after running
none, part or all of its work, a sandbox that dies, each on the call itself or on a replay it
causes; and nondeterministic tools. `tests/cache/exactness.py` holds the scenarios;
`lab/replay/exactness/` the referee (a fresh sandbox per rollout and the pure ToolCallGraph)
and the meaning of each property.

The faults come from a subclass of the directory backend that stands in for the process's
directory backend in the registry's cache (`sandboxes.backends.backend_for`) while a test runs:
the service code has no test-only branch. It also offers the two nondeterministic tools.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

import cache.services.record as record
import sandboxes.backends as registry
from cache.models import Rollout, Task
from cache.services import kept_history
from cache.tcg.snapshots import SnapshotCosts
from lab.replay.exactness import Outcome, Referee, Step
from sandboxes.backends.base import EngineUnavailable, SandboxGone, ToolSpec
from sandboxes.backends.directory import DirectoryBackend, DirectorySandbox
from sandboxes.handles import sandbox_config

from .exactness import (
    FAULTS,
    READ_A,
    READ_C,
    SAMPLE,
    SEED_FILES,
    SLOW_CALL_S,
    SNAPSHOT_COSTS,
    STAMP,
    TASK_SETTINGS,
    WRITE_A,
    WRITE_C,
    Fault,
    any_calls,
    call,
    deterministic_calls,
    folder_files,
    is_slow,
    partial_args,
    play,
    scenario_referee,
    scenarios,
    snapshotted_nodes,
    steer,
    stored_nodes,
    stored_snapshots,
    timed_out_result,
    token,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

KINDS = ("timeout", "error", "gone")
# No explain phase: it reruns the failing example many times over, for little here.
PROPERTY = settings(
    max_examples=int(os.environ.get("TVCACHE_PROPERTY_EXAMPLES", "25")),
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


class FaultySandbox(DirectorySandbox):
    """A directory sandbox whose executions the armed fault may strike."""

    def execute(self, tool, args):
        return self._serve(tool, args, observe=False)[0]

    def execute_observed(self, tool, args):
        return self._serve(tool, args, observe=True)

    def _serve(self, tool, args, *, observe: bool):
        fault = FAULTS.take(tool, args)
        if fault is not None:
            return self._struck(tool, args, fault)
        if is_slow(tool, args):
            time.sleep(SLOW_CALL_S)
        if tool == STAMP:
            return self._stamp(args, token()), None
        if tool == SAMPLE:
            return {"output": token(), "ok": True}, None
        if observe:
            return super().execute_observed(tool, args)
        return super().execute(tool, args), None

    def _stamp(self, args, value: str) -> dict:
        written = super().execute("write_file", {"path": args["path"], "content": value})
        return {"output": value, "ok": written["ok"]}

    def _struck(self, tool, args, fault: Fault):
        if fault.effect == "full" or (fault.effect == "partial" and partial_args(tool, args) is None):
            self._run_plain(tool, args)
        elif fault.effect == "partial":
            super().execute(tool, partial_args(tool, args))
        if fault.kind == "timeout":
            changed = fault.effect != "none" and self._backend.tool_spec(tool).mutates_state
            return timed_out_result(), None if changed else False
        if fault.kind == "gone":
            self._backend.remove_sandbox(self.sandbox_id)
            raise SandboxGone(f"directory sandbox {self.sandbox_id} died during the call")
        raise EngineUnavailable("the sandbox's exec stream broke after the call started")

    def _run_plain(self, tool, args) -> None:
        if tool == STAMP:
            self._stamp(args, token())
        elif tool != SAMPLE:
            super().execute(tool, args)


class FaultyDirectoryBackend(DirectoryBackend):
    tools = {**DirectoryBackend.tools, STAMP: ToolSpec(mutates_state=True), SAMPLE: ToolSpec(mutates_state=False)}

    def _open(self, sandbox_id):
        folder = self.sandboxes.path(sandbox_id)
        assert folder is not None
        return FaultySandbox(self, sandbox_id, folder)


@pytest.fixture
def faulty_backend(tmp_path, monkeypatch):
    """The faulty backend serves every directory task of the process while the test runs, and
    snapshot costs are fixed (exactness.SNAPSHOT_COSTS)."""
    config = sandbox_config()
    backend = FaultyDirectoryBackend(tmp_path / "service", config.directory)
    monkeypatch.setitem(registry._instances, ("directory", (config.root, config.directory)), backend)
    monkeypatch.setattr(record, "backend_costs", lambda backend: SnapshotCosts(*SNAPSHOT_COSTS))
    yield backend
    FAULTS.arm(None, {})


class DirectoryOracle:
    """A fresh sandbox of the plain directory backend: the re-execution of a rollout's history."""

    def __init__(self, backend: DirectoryBackend):
        self._backend = backend
        self._sandbox = backend.start({"backend": "directory", "files": SEED_FILES}, labels={})

    def files(self):
        return folder_files(self._backend.sandboxes.path(self._sandbox.sandbox_id) / "files")

    def execute_observed(self, call):
        return self._sandbox.execute_observed(call["tool"], call["args"])

    def stop(self):
        self._sandbox.stop()


def drive(api, oracle_backend, steps: list[Step]) -> Referee:
    task = f"props-{uuid.uuid4().hex[:12]}"
    response = api.put(
        f"/api/v1/tasks/{task}", {"env": {"backend": "directory", "files": SEED_FILES}, **TASK_SETTINGS}, format="json"
    )
    assert response.status_code == 201, response.content
    referee = scenario_referee(lambda: DirectoryOracle(oracle_backend), retired=("gone", "error"))
    play(task, steps, referee, lambda step: _call(api, task, step))
    referee.violations["exact"] += _store_violations(api, task, referee)
    for rollout in {step.rollout for step in steps}:
        api.delete(f"/api/v1/tasks/{task}/rollouts/r{rollout}")
    referee.finish(snapshotted_nodes(task))
    return referee


def _store_violations(api, task: str, referee: Referee) -> list[str]:
    backend = registry.backend_for("directory", sandbox_config())

    def served(history, c):
        response = api.post(
            f"/api/v1/tasks/{task}/lookup", {"history": history, "call": c, "resume": False}, format="json"
        )
        assert response.status_code == 200, response.content
        body = response.json()
        return body["result"] if body["hit"] else None

    def snapshot_files(ref):
        return folder_files(backend.snapshots.path(ref) / "files")

    return referee.store_violations(
        fingerprint=Task.objects.get(pk=task).env_fingerprint,
        histories=[
            [call.to_json() for call in kept_history(pk, length)]
            for pk, length in Rollout.objects.filter(task_id=task).values_list("pk", "history_length")
        ],
        nodes=stored_nodes(task),
        snapshots=stored_snapshots(task, snapshot_files),
        served=served,
    )


def _call(api, task: str, step: Step) -> Outcome:
    try:
        response = api.post(f"/api/v1/tasks/{task}/rollouts/r{step.rollout}/calls", {"call": step.call}, format="json")
    except Exception as exc:  # the test client re-raises what the view let escape: a 500
        return Outcome(fired=False, failure=f"500 {type(exc).__name__}: {exc}")
    if response.status_code != 200:
        clean = response.status_code < 500 or response.status_code == 503
        return Outcome(
            fired=False,
            failure=f"{response.status_code} {response.content[:300]!r}",
            clean_failure=clean and "error" in response.json(),
        )
    body = response.json()
    return Outcome(
        fired=False, result=body["result"], cached=body["cached"], node_id=body["node_id"], mutates=body["mutates"]
    )


deterministic = scenarios(deterministic_calls(patches=True), KINDS)

# Minimal failing examples hypothesis found on earlier code (shrunk, then cut by hand).
# A write times out after writing half its content; the service appends it to the history as if it
# had completed, and the read after it is recorded under the completed write's state.
TIMEOUT_MIDWAY = [Step(0, WRITE_A, Fault("timeout", "partial", "call")), Step(0, READ_A, None)]
# The engine fails after the write ran: the sandbox keeps the write, the history does not, and the
# read after it is recorded under the root's state.
ERROR_AFTER_RUNNING = [Step(0, WRITE_A, Fault("error", "full", "call")), Step(0, READ_A, None)]
# r1's sandbox replays a write it hit; the replay times out and is taken as done.
REPLAY_TIMES_OUT = [
    Step(0, WRITE_A, None),
    Step(1, READ_C, None),
    Step(1, WRITE_A, None),
    Step(1, READ_A, Fault("timeout", "none", "first")),
]
# The same replay fails with an engine error: a 500 (toolserver._rollout_sandbox lets it escape).
REPLAY_FAILS = [
    Step(0, WRITE_A, None),
    Step(1, READ_C, None),
    Step(1, WRITE_A, None),
    Step(1, READ_A, Fault("error", "none", "first")),
]
# A read times out; the rollout stays in the shared graph: r1 hits r0's later read, and r0's
# later write is snapshotted.
READ_TIMES_OUT = [Step(0, READ_A, Fault("timeout", "none", "call")), Step(0, READ_C, None), Step(1, READ_C, None)]
SNAPSHOT_AFTER_TIMEOUT = [Step(0, READ_A, Fault("timeout", "none", "call")), Step(0, WRITE_C, None)]
# r1 hit r0's write; its next call's catch-up replay of that write times out. The service retires
# that sandbox and rebuilds the state from the root: r1 stays on the shared graph, and what it
# records after (and the snapshot of it) is exact.
REPLAY_TIMES_OUT_THEN_REBUILT = [
    Step(0, WRITE_A, None),
    Step(1, WRITE_A, None),
    Step(1, WRITE_C, Fault("timeout", "none", "first")),
]
# A rollout detached by a timed-out write loses its own sandbox: its state is gone with it, and
# its later calls answer 409 rollout_state_unknown.
DETACHED_SANDBOX_DIES = [
    Step(0, WRITE_A, Fault("timeout", "none", "call")),
    Step(0, call("sample"), Fault("gone", "none", "call")),
    Step(0, READ_A, None),
]


@PROPERTY
@given(steps=deterministic)
@example(steps=TIMEOUT_MIDWAY)
@example(steps=ERROR_AFTER_RUNNING)
@example(steps=REPLAY_TIMES_OUT)
def test_every_answer_equals_a_fresh_re_execution_of_the_history(api, faulty_backend, tmp_path, steps):
    referee = steer(drive(api, DirectoryBackend(tmp_path / "oracle"), steps))
    assert not referee.violations["exact"], referee.report("exact", steps)


@PROPERTY
@given(steps=deterministic)
@example(steps=READ_TIMES_OUT)
def test_the_store_answers_what_the_pure_graph_answers(api, faulty_backend, tmp_path, steps):
    referee = steer(drive(api, DirectoryBackend(tmp_path / "oracle"), steps))
    assert not referee.violations["oracle"], referee.report("oracle", steps)


@PROPERTY
@given(steps=deterministic)
@example(steps=READ_TIMES_OUT)
@example(steps=SNAPSHOT_AFTER_TIMEOUT)
@example(steps=REPLAY_TIMES_OUT_THEN_REBUILT)
def test_a_rollout_leaves_the_shared_graph_after_a_fault(api, faulty_backend, tmp_path, steps):
    referee = steer(drive(api, DirectoryBackend(tmp_path / "oracle"), steps))
    assert not referee.violations["isolation"], referee.report("isolation", steps)


@PROPERTY
@given(steps=scenarios(any_calls(patches=True), KINDS))
@example(steps=REPLAY_FAILS)
@example(steps=DETACHED_SANDBOX_DIES)
def test_nondeterministic_tools_and_faults_neither_crash_nor_corrupt_other_rollouts(
    api, faulty_backend, tmp_path, steps
):
    referee = steer(drive(api, DirectoryBackend(tmp_path / "oracle"), steps))
    assert not referee.violations["crash"], referee.report("crash", steps)
    assert not referee.violations["exact"], referee.report("exact", steps)
