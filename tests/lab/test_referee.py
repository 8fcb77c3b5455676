"""The replay's exactness referee (exactness.ReplayReferee), on samples made by hand over
a toy environment: a cached answer that differs from the no-cache arm's execution is a mismatch
unless a fresh execution of the rollout's own history, paced otherwise, gives it too; then the
call is nondeterministic and counted apart."""

from __future__ import annotations

import itertools

from lab.replay.arms import Arm
from lab.replay.exactness import ReplayReferee
from lab.replay.pacing import Pacing
from lab.replay.plans import RolloutPlans
from lab.replay.samples import CallSample, EpochRun, digest
from lab.replay.workload import ReplayTask, Workload
from tvclient import ToolExecutionEnvironment

WRITE, READ = {"tool": "write", "args": {}}, {"tool": "read", "args": {}}
ANSWERS = itertools.cycle(["a", "b"])  # the read answers "a", then "b", then "a"...


class Flaky(ToolExecutionEnvironment):
    backend = "toy"

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def fork(self):
        raise NotImplementedError

    def execute(self, call):
        return {"out": next(ANSWERS) if call["tool"] == "read" else "ok"}


class Toy(Workload):
    name = "toy"

    def tasks(self):
        return [ReplayTask("t", {}, {"backend": "external"}, None, Flaky)]

    def rollouts(self, task, epoch):
        return [[WRITE, READ], [WRITE, READ]]

    def describe(self):
        return {}


def sample(arm_cached: bool | None, rollout: int, answer: str) -> CallSample:
    out = CallSample("t", 0, rollout, 1, "read", 1.0, arm_cached, None, digest({"out": answer}))
    out.key = ("state-after-write", "read-digest")
    return out


def check(cached_answer: str, fresh_answers: tuple[str, str]) -> dict:
    toy = Toy()
    plans = RolloutPlans(toy, toy.tasks(), [Arm("nocache", "nocache"), Arm("server", "server")], epochs=1, faults=None)
    referee = ReplayReferee(toy.tasks(), plans, Pacing(seed=1))
    runs = {
        "nocache": EpochRun("nocache", 0, calls=[sample(None, r, fresh_answers[r]) for r in (0, 1)]),
        "server": EpochRun("server", 0, calls=[sample(True, 0, cached_answer)]),
    }
    referee.check(runs, 0)
    return runs["server"].exact


def test_an_answer_a_new_fresh_execution_gives_is_nondeterministic_not_wrong():
    exact = check("b", ("a", "a"))  # the first new execution answers "a" or "b": within 2 tries, "b"
    assert exact["hits_mismatches"] == 0 and exact["hits_nondeterministic"] == 1


def test_an_answer_no_fresh_execution_gives_is_a_mismatch():
    exact = check("c", ("a", "a"))
    assert exact["hits_mismatches"] == 1 and exact["hits_nondeterministic"] == 0
