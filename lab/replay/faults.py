"""The replays' fault arm (`--faults`): seeded, bounded faults in the rollouts, to measure whether
anything wrong gets through when calls time out, sandboxes die, environments fail and the service
restarts, and what the known-state rule costs in hit rate.

A fraction `rate` of the rollouts of every task and epoch gets one fault; its kind and call are a
pure function of the seed, the task, the epoch and the rollout, so every arm of a run (and every
run with the same seed) meets the same faults. Kinds:

- `timeout` (workloads with calls that run long enough, terminal: every arm, the fresh executions
  too): the call is given a small `timeout_s` and is killed mid-run. The kill is part of the
  workload's world: the no-cache arm runs the same call and is killed at the same point (inside
  the call's leading `sleep`), so it stays the reference for the calls that follow.
- `error_after` (client mode): the rollout's environment runs the call, then raises, as an
  engine error after the call ran (a broken exec stream, an inspect error) does.
- `timeout_after` (client mode): the environment runs the call, then answers `timed_out: true`.
- `sandbox_death` (tool-server mode, docker): the rollout's container is removed (killed) between
  two calls, before the chosen call or, if the rollout has no container yet, before the first
  later call at which it has one.
- a service restart (client and tool-server mode, once per arm, in the middle epoch, when a seeded
  share of its calls are done): the web service is killed (SIGKILL to its process tree) and
  started again on the same port and database while rollouts are in flight. A rollout whose
  request got no answer sends it again until the service answers.

The environment faults fire only when the rollout's own environment runs the call (a hit runs
nothing) and only on a call that differs from every earlier call of the rollout, so that no replay
of an earlier call fires it. The environment ran the call in full, so the fresh execution without
the fault stays the reference for the calls after it; the faulted answer itself is not compared.

Unknown-state events (the known-state rule: from there the rollout leaves the shared graph): a
call answered `timed_out`, a fired environment fault, a sandbox death (from the call after it), a
call left without an answer. The fault-aware oracle lets a rollout's calls after its event hit only
what the same rollout issued after it. A restart is no such event: the rollout's history is what
it was, and the call it got no answer for is sent again.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tvclient import TVCacheClient

    from .workload import Call, Workload

log = logging.getLogger("tvcache.replay")

# The modes each kind is injected in; "all" includes the no-cache arm (the fault is in the world).
KIND_MODES = {
    "timeout": ("nocache", "client", "server"),
    "error_after": ("client",),
    "timeout_after": ("client",),
    "sandbox_death": ("server",),
}
ENV_FAULTS = ("error_after", "timeout_after")  # the kinds the rollout's own environment injects
RESTART_SHARE = (0.3, 0.6)  # of the middle epoch's calls done when the service is restarted


class InjectedFault(Exception):
    """What a faulty environment raises after it ran the call."""


@dataclass(frozen=True)
class Fault:
    kind: str
    position: int  # the call it hits (sandbox_death: the call before which the container dies)

    def applies(self, mode: str) -> bool:
        return mode in KIND_MODES[self.kind]


@dataclass(frozen=True)
class FaultPlan:
    seed: int
    rate: float = 0.25
    timeout_s: float = 1.0  # the small timeout given to a `timeout` call
    restart: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.rate <= 1:
            raise ValueError("the fault rate is a share of the rollouts, from 0 to 1")

    def describe(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "rate": self.rate,
            "timeout_s": self.timeout_s,
            "restart": self.restart,
            "kinds": {kind: list(modes) for kind, modes in KIND_MODES.items()},
        }

    def choose(self, workload: Workload, task: str, epoch: int, index: int, calls: list[Call]) -> Fault | None:
        """The rollout's fault, if it gets one (`calls`: the workload's calls, before any fault)."""
        rng = random.Random(f"{self.seed}-faults-{task}-{epoch}-{index}")
        if not workload.fault_kinds or rng.random() >= self.rate:
            return None
        kind = rng.choice(workload.fault_kinds)
        positions = self._eligible(workload, kind, calls)
        return Fault(kind, rng.choice(positions)) if positions else None

    def _eligible(self, workload: Workload, kind: str, calls: list[Call]) -> list[int]:
        if kind == "timeout":
            return [i for i, call in enumerate(calls) if workload.timeout_call(call, self.timeout_s) is not None]
        # Not the first call (rollouts share their start) nor, for the environment's faults, a
        # call equal to an earlier one (a replay of that one would fire it).
        return [i for i in range(1, len(calls)) if kind == "sandbox_death" or calls[i] not in calls[:i]]

    def world(self, workload: Workload, calls: list[Call], fault: Fault | None) -> list[Call]:
        """The rollout's calls as every arm issues them: with the `timeout` fault's small timeout."""
        if fault is None or fault.kind != "timeout":
            return calls
        out = list(calls)
        out[fault.position] = workload.timeout_call(calls[fault.position], self.timeout_s)
        return out

    def restart_point(self, arm: str, epochs: int, calls: int) -> tuple[int, int] | None:
        """(epoch, calls done in it) at which the arm's service restart happens."""
        if not self.restart or calls == 0:
            return None
        rng = random.Random(f"{self.seed}-restart-{arm}")
        return epochs // 2, max(1, int(calls * rng.uniform(*RESTART_SHARE)))


def faulty_answer(kind: str, result: Any) -> Any:
    """What an environment that ran the call answers instead of `result` (or raises)."""
    if kind == "error_after":
        raise InjectedFault("injected: the environment failed after it ran the call")
    return {"timed_out": True, "error": "injected: the call timed out after it ran"}


def timed_out(result: Any) -> bool:
    return isinstance(result, dict) and bool(result.get("timed_out"))


# ---------------------------------------------------------------------------------------------
# Sandbox deaths (tool-server mode)


def kill_rollout_sandbox(client: TVCacheClient, task_id: str, rollout_id: str) -> str | None:
    """Remove (kill) the docker container the service leased to the rollout; the container's id,
    or None when the rollout has none now. The service says which one over its API
    (`GET /api/v1/tasks/{id}/sandboxes`); only a container whose labels name this task, that
    sandbox and this installation's database is touched: never another run's or another agent's."""
    import docker

    from sandboxes.handles import SANDBOX_LABEL, TASK_LABEL, instance_selector

    leased = [
        row
        for row in client.sandboxes(task_id)["live"]
        if row["rollout_id"] == rollout_id and row["state"] == "leased" and row["backend"] == "docker" and row["ref"]
    ]
    if not leased:
        return None
    row = max(leased, key=lambda r: r["id"])
    engine = docker.from_env()
    try:
        container = engine.containers.get(row["ref"])
        expected = {TASK_LABEL: task_id, SANDBOX_LABEL: str(row["id"]), **instance_selector()}
        if any(container.labels.get(key) != value for key, value in expected.items()):
            log.warning("container %s is not sandbox %s of task %s: left alone", row["ref"][:12], row["id"], task_id)
            return None
        container.remove(force=True)
        return container.id
    except docker.errors.NotFound:
        return None
    finally:
        engine.close()


def divergence_count(stats: dict[str, Any]) -> dict[str, int] | None:
    """The service's `divergences` of a task's stats as counts ({"count", "audit", "state",
    "divergent_nodes"}, whichever it reports), None when its stats carry none."""
    value = stats.get("divergences")
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return {"count": int(value)}
    if isinstance(value, list):
        return {"count": len(value)}
    if not isinstance(value, dict):
        return None
    out = {key: int(value[key]) for key in ("count", "divergent_nodes") if isinstance(value.get(key), (int, float))}
    for kind in ("audit", "state"):
        per_tool = [row.get(kind) for row in value.get("per_tool") or [] if isinstance(row, dict)]
        if any(isinstance(n, (int, float)) for n in per_tool):
            out[kind] = int(sum(n for n in per_tool if isinstance(n, (int, float))))
    return out
