"""The replays' referee: each epoch's cached answers against the no-cache arm, and the keys of
the replay's own oracle."""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from typing import Any

from cache.tcg import TaskPolicy, ToolCall, call_digest, next_state_key, root_state_key

from ..arms import Arm
from ..pacing import Pacing
from ..plans import RolloutPlans
from ..samples import CallSample, EpochRun, digest
from ..workload import Call, ReplayTask
from .verdict import judge

# A mismatch is checked against up to this many more fresh executions of the rollout's own
# history, paced differently (a rollout's pacing is not part of its history: back to back, at the
# replay's thinking time, and with up to 1.5 s between calls, in turn). An answer one of them gives
# is a live outcome of the history: the call is nondeterministic (timing: whether a same-size
# rewrite lands in the second a bytecode cache recorded depends on how long the calls between
# took), counted apart from the mismatches, which no fresh execution reproduced.
REPRODUCE_TRIES = 8
EXACT_KEYS = (
    "hits_checked",
    "hits_mismatches",
    "misses_checked",
    "misses_mismatches",
    "not_compared",
    "hits_nondeterministic",
    "misses_nondeterministic",
    "after_event_hits_checked",
    "after_event_hits_mismatches",
    "after_event_misses_checked",
    "after_event_misses_mismatches",
)


def call_keys(task: ReplayTask, samples: list[CallSample], calls: list[Call]) -> list[tuple[str, str] | None]:
    """Each call's (anchor state key, call digest) as the service keys it, None where the tool
    is not cacheable: the harness's own oracle is computed from these (report.py). A call the
    service answered as read-only (`sample.mutates` False) leaves the state key as it was."""
    policy = TaskPolicy.from_json(task.tools)
    state = root_state_key(hashlib.sha256(task.name.encode()).hexdigest())  # keys are compared within a task
    keys = []
    for sample, call in zip(samples, calls):
        tool_call = ToolCall.from_json(call)
        key = call_digest(tool_call)
        tool = policy.for_tool(tool_call.tool)
        keys.append((state, key) if tool.cacheable else None)
        if tool.changes_state(sample.mutates):
            state = next_state_key(state, key)
    return keys


class ReplayReferee:
    """Judges each epoch's cached answers against the no-cache arm and keeps the first
    `keep_examples` mismatches (`examples`)."""

    def __init__(self, tasks: list[ReplayTask], plans: RolloutPlans, pacing: Pacing, keep_examples: int = 5):
        self.tasks = tasks
        self.plans = plans
        self.pacing = pacing
        self.keep_examples = keep_examples
        self.examples: list[dict[str, Any]] = []

    def check(self, epoch_runs: dict[str, EpochRun], epoch: int) -> None:
        """Sets every run's `exact` (EXACT_KEYS and `mismatched_tools`), then drops the results."""
        fresh_run = next((run for name, run in epoch_runs.items() if Arm.parse(name).mode == "nocache"), None)
        if fresh_run is None:
            raise ValueError("the exactness check needs the nocache arm")
        fresh = {(s.task, s.rollout, s.position): s for s in fresh_run.calls}
        for run in epoch_runs.values():
            tally: Counter[str] = Counter()
            mismatched_tools: Counter[str] = Counter()
            for sample in run.calls:
                if sample.cached is None:
                    continue
                if sample.injected or sample.failed:  # the answer is the fault's, or there is none
                    tally["not_compared"] += 1
                    continue
                reference = fresh[(sample.task, sample.rollout, sample.position)]
                verdict = judge(
                    sample.result_digest,
                    reference.result_digest,
                    cached=sample.cached,
                    reproduce=lambda: self._reproduced(sample, epoch),
                )
                # Also after an unknown-state event: the fresh execution met the same timeouts, and
                # an environment fault or a dead sandbox came after its call had run.
                prefixes = ("", "after_event_") if sample.unshared else ("",)
                for prefix in prefixes:
                    tally[f"{prefix}{verdict.kind}_checked"] += 1
                if verdict.reproduced_after is not None:
                    tally[f"{verdict.kind}_nondeterministic"] += 1
                    self._keep_example(run, sample, reference, reproduced_after=verdict.reproduced_after)
                elif verdict.wrong:
                    for prefix in prefixes:
                        tally[f"{prefix}{verdict.kind}_mismatches"] += 1
                    mismatched_tools[sample.tool] += 1
                    self._keep_example(run, sample, reference)
            run.exact = {key: tally.get(key, 0) for key in EXACT_KEYS}
            run.exact["mismatched_tools"] = dict(mismatched_tools)
        for run in epoch_runs.values():
            for sample in run.calls:
                sample.result = None

    def _reproduced(self, sample: CallSample, epoch: int) -> int | None:
        """After how many fresh executions of the rollout's history and the call one answered as
        `sample` did; None if none of REPRODUCE_TRIES did."""
        calls = self.plans.rollouts(sample.task, epoch)[sample.rollout][: sample.position + 1]
        task = next(t for t in self.tasks if t.name == sample.task)
        paces = self.pacing.reproduction(sample.task, sample.rollout, sample.position)
        for attempt in range(1, REPRODUCE_TRIES + 1):
            pace = paces[(attempt - 1) % len(paces)]
            env = task.make_env()
            env.start()
            try:
                for call in calls:
                    time.sleep(pace())
                    result = env.execute(call)
            finally:
                env.stop()
            if digest(result) == sample.result_digest:
                return attempt
        return None

    def _keep_example(
        self, run: EpochRun, sample: CallSample, reference: CallSample, reproduced_after: int | None = None
    ) -> None:
        if len(self.examples) >= self.keep_examples:
            return
        fault = self.plans.rollout_fault(sample.task, run.epoch, sample.rollout)
        self.examples.append(
            {
                "arm": run.arm,
                "epoch": run.epoch,
                "task": sample.task,
                "rollout": sample.rollout,
                "position": sample.position,
                "cached": sample.cached,
                "call": sample.tool,
                "result": json.loads(json.dumps(sample.result)),
                "fresh": json.loads(json.dumps(reference.result)),
                **({"reproduced_after_fresh_executions": reproduced_after} if reproduced_after is not None else {}),
                **(
                    {
                        "after_unknown_state": sample.unshared,
                        "retries": sample.retries,
                        "rollout_fault": None
                        if fault is None or not fault.applies(Arm.parse(run.arm).mode)
                        else {"kind": fault.kind, "position": fault.position},
                    }
                    if self.plans.faults is not None
                    else {}
                ),
            }
        )
