"""The property tests' referee: a scenario's steps, judged as a driver plays them against the
store (tests/cache/exactness.py drives them, in tool-server and client mode)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from cache.tcg import TaskPolicy, ToolCall, env_fingerprint, state_chain
from cache.tcg.graph import Hit, ToolCallGraph

from ..faults import timed_out
from .verdict import judge


class Oracle(Protocol):
    """A fresh sandbox of the scenario's task: the re-execution of a rollout's history."""

    def execute_observed(self, call: dict) -> tuple[Any, bool | None]: ...

    def files(self) -> dict[str, bytes]: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Step:
    rollout: int
    call: dict
    fault: Any  # the fault armed for the step, None for none; the referee reads its `kind`


@dataclass
class Outcome:
    """What the driver saw for one step."""

    fired: bool  # the step's fault struck an execution
    result: Any = None
    cached: bool = False
    node_id: int | None = None
    mutates: bool | None = None  # the call joined the rollout's history
    failure: str | None = None  # an error: expected only when the fault fired
    clean_failure: bool = False  # the error is the fault itself, or the API's error JSON for it
    created: frozenset[int] = frozenset()  # nodes the step created


@dataclass(frozen=True)
class StoredNode:
    node_id: int
    anchor_key: str
    state_key: str
    call: dict
    result: Any


@dataclass(frozen=True)
class StoredSnapshot:
    node_id: int
    state_key: str
    files: dict[str, bytes]


@dataclass
class _Rollout:
    oracle: Oracle | None = None
    history: list[ToolCall] = field(default_factory=list)  # the graph's history of the rollout
    faulted_at: int | None = None
    tainted_at: int | None = None  # ran a nondeterministic state-changing tool
    broken: bool = False  # met an unexpected failure: nothing more can be said of it
    nodes_after_fault: set[int] = field(default_factory=set)


def _recovered(outcome: Outcome) -> bool:
    """A struck call that was answered normally and recorded (a timed-out or unrecorded call is not)."""
    return (
        outcome.failure is None and not outcome.cached and outcome.node_id is not None and not timed_out(outcome.result)
    )


def _tool_call(data: dict) -> ToolCall:
    return ToolCall(data["tool"], data["args"])


class Referee:
    """Judges a scenario's steps as a driver plays them against the store. It keeps, per rollout, a
    sandbox of its own that runs every call the rollout issued (the fresh re-execution: the tools
    not in `nondeterministic` are deterministic), and one pure `ToolCallGraph` fed with the answers
    of rollouts that never met a fault (the oracle). Its verdicts, by property:

    - exact: every answer to a rollout that has met no fault and run no nondeterministic
      state-changing tool equals the fresh re-execution of its history (hits and misses alike); and
      at the end, whatever the store would serve to any rollout (each node a plain history reaches,
      each live snapshot) equals a fresh re-execution of its path (`store_violations`): a wrong
      result counts even when the scenario happened not to issue the call again;
    - oracle: such a rollout's deterministic call hits exactly when the graph holds it, with the
      graph's result and state effect;
    - isolation: a node created by a rollout at or after its fault is never served to another
      rollout, and never snapshotted;
    - crash: a call no fault struck is answered; a struck one is answered or fails cleanly.
    """

    PROPERTIES = ("exact", "oracle", "isolation", "crash")
    GRAPH_FINGERPRINT = env_fingerprint({"props": 1})  # the graph's own: its keys are compared among themselves

    def __init__(
        self,
        oracle_factory: Callable[[], Oracle],
        *,
        policy: TaskPolicy,
        nondeterministic: frozenset[str],
        retired: tuple[str, ...] = (),
    ):
        """`retired`: fault kinds after which the sandbox is retired and the rollout goes on from
        its history (tool-server mode: a dead sandbox, an engine error once the call may have run)."""
        self._oracle_factory = oracle_factory
        self.policy = policy
        self.nondeterministic = nondeterministic
        self.retired = retired
        self.graph = ToolCallGraph(self.GRAPH_FINGERPRINT, policy)
        self.rollouts: dict[int, _Rollout] = {}
        self.violations: dict[str, list[str]] = {name: [] for name in self.PROPERTIES}
        # What hypothesis steers towards (`target`): faults that struck, rollouts that went on
        # after theirs, and other rollouts reaching what they created meanwhile.
        self.pressure = {"faults struck": 0.0, "calls after a fault": 0.0, "hits on nodes made after a fault": 0.0}

    def _flag(self, prop: str, index: int, step: Step, message: str) -> None:
        where = f"step {index} (rollout r{step.rollout}, {step.call}, fault {step.fault})"
        self.violations[prop].append(f"{where}: {message}")

    def _taints(self, tool: str) -> bool:
        """A nondeterministic tool that changes state: no fresh execution can follow the rollout past it."""
        return tool in self.nondeterministic and self.policy.for_tool(tool).mutates_state

    def observe(self, index: int, step: Step, outcome: Outcome) -> None:
        rollout = self.rollouts.setdefault(step.rollout, _Rollout(oracle=self._oracle_factory()))
        if rollout.broken:
            return
        if (
            outcome.failure is not None
            and not outcome.fired
            and (rollout.tainted_at is not None or rollout.faulted_at is not None)
            and "rollout_state_unknown" in outcome.failure
        ):
            # The rollout left the shared graph in a sandbox of its own (after its fault, or a replay
            # of its nondeterministic write that could not reach the recorded state), and that
            # sandbox died since: its state is lost with it, and the service says so.
            rollout.broken = True
            return
        if outcome.failure is not None and not outcome.fired:
            self._flag("crash", index, step, f"no fault struck, yet the call failed: {outcome.failure}")
            rollout.broken = True
            return
        if outcome.fired and outcome.failure is not None and not outcome.clean_failure:
            self._flag("crash", index, step, f"a fault is answered with a server error: {outcome.failure}")
        if outcome.fired and _recovered(outcome):
            # The fault struck a replay that was catching the rollout's sandbox up, not the call:
            # the service retired that sandbox, rebuilt the state from the root, ran the call there
            # and recorded it. The rollout is where its history says; its answer is judged as any
            # other (a wrong recovery fails the exact property, here and in the store at the end).
            outcome.fired = False
        self._check_isolation(index, step, outcome)
        if rollout.faulted_at is not None:
            rollout.nodes_after_fault |= outcome.created
            self.pressure["calls after a fault"] += 1
            return
        answer = self.graph.lookup(rollout.history, _tool_call(step.call))
        exact = rollout.tainted_at is None and step.call["tool"] not in self.nondeterministic
        if outcome.fired and step.fault.kind in self.retired and outcome.failure is not None:
            # The sandbox died, and whatever the call did went with it: the service retires it and
            # the rollout goes on from its history (the call is not in it), which the exact
            # property checks. Retiring is the known-state rule's other option (docs/design/guarantees.md).
            return
        if outcome.fired:
            if exact and isinstance(answer, Hit):
                self._flag("oracle", index, step, "the graph holds this call, yet it was executed")
            rollout.faulted_at = index
            rollout.nodes_after_fault |= outcome.created
            self.pressure["faults struck"] += 1
            self._stop_oracle(rollout)
            return
        observed = None
        expected = None
        if exact:
            expected, observed = rollout.oracle.execute_observed(step.call)
            verdict = judge(outcome.result, expected, cached=outcome.cached)
            if verdict.wrong:
                self._flag(
                    "exact",
                    index,
                    step,
                    f"{verdict.answer} answered {outcome.result!r}; fresh execution gives {expected!r}",
                )
            self._check_oracle(index, step, outcome, answer, observed)
        self._follow(rollout, step, outcome, answer, observed, expected if exact else outcome.result)
        if self._taints(step.call["tool"]) and rollout.tainted_at is None:
            rollout.tainted_at = index
            self._stop_oracle(rollout)

    def _check_oracle(self, index: int, step: Step, outcome: Outcome, answer, observed: bool | None) -> None:
        if isinstance(answer, Hit):
            if not outcome.cached:
                self._flag("oracle", index, step, "the graph holds this call, yet it was executed (a missed hit)")
            elif (outcome.result, outcome.mutates) != (answer.result, answer.mutates):
                self._flag(
                    "oracle",
                    index,
                    step,
                    f"hit {outcome.result!r} (mutates {outcome.mutates}); the graph "
                    f"holds {answer.result!r} (mutates {answer.mutates})",
                )
            return
        if outcome.cached:
            self._flag(
                "oracle",
                index,
                step,
                f"hit node {outcome.node_id} ({outcome.result!r}), which no rollout in the shared graph recorded",
            )
        elif outcome.mutates != self.policy.for_tool(step.call["tool"]).changes_state(observed):
            self._flag("oracle", index, step, f"joined the history: {outcome.mutates}; observed change: {observed}")

    def _follow(self, rollout: _Rollout, step: Step, outcome: Outcome, answer, observed, result) -> None:
        """The graph as the shared store should hold it after this call."""
        c = _tool_call(step.call)
        if isinstance(answer, Hit):
            mutates = answer.mutates
        else:
            if observed is None and outcome.mutates is False and self.policy.for_tool(c.tool).mutates_state:
                observed = False  # a nondeterministic call: as the service or client saw it
            self.graph.record(rollout.history, c, result, mutated=observed)
            mutates = self.policy.for_tool(c.tool).changes_state(observed)
        if mutates:
            rollout.history.append(c)

    def _check_isolation(self, index: int, step: Step, outcome: Outcome) -> None:
        if not outcome.cached or outcome.node_id is None:
            return
        for other_index, other in self.rollouts.items():
            if other_index != step.rollout and outcome.node_id in other.nodes_after_fault:
                self.pressure["hits on nodes made after a fault"] += 1
                self._flag(
                    "isolation",
                    index,
                    step,
                    f"hit node {outcome.node_id}, created by r{other_index} at or "
                    f"after its fault at step {other.faulted_at}",
                )

    def finish(self, snapshotted_nodes: set[int]) -> None:
        for index, rollout in self.rollouts.items():
            taken = rollout.nodes_after_fault & snapshotted_nodes
            if taken:
                self.violations["isolation"].append(
                    f"r{index}: nodes {sorted(taken)} created at or after its fault (step {rollout.faulted_at}) "
                    "were snapshotted"
                )
            self._stop_oracle(rollout)

    @staticmethod
    def _stop_oracle(rollout: _Rollout) -> None:
        if rollout.oracle is not None:
            rollout.oracle.stop()
            rollout.oracle = None

    def report(self, prop: str, steps: list[Step]) -> str:
        script = "\n".join(f"  {i}: r{s.rollout} {s.call} fault={s.fault}" for i, s in enumerate(steps))
        return f"{prop} violated:\n" + "\n".join(self.violations[prop]) + f"\nsteps:\n{script}"

    def store_violations(
        self,
        *,
        fingerprint: str,
        histories: list[list[dict]],
        nodes: list[StoredNode],
        snapshots: list[StoredSnapshot],
        served: Callable[[list[dict], dict], Any | None],
    ) -> list[str]:
        """What the store would serve to any rollout, checked against fresh execution.

        A node reachable by a plain history (a prefix of a history the service or client keeps for a
        rollout) is what every rollout with that history gets on a hit, whether or not the scenario
        happened to issue it again; a live snapshot is the state every fork of it starts from. Nodes
        under keys no plain history reaches (a rollout's private branch) cannot be served and are
        left alone; so are paths through nondeterministic tools. `served(history, call)` is the
        service's lookup: the result of a hit, None for a miss.
        """
        paths: dict[str, list[dict]] = {}  # state key -> a plain history that reaches it
        for history in histories:
            chain = state_chain(fingerprint, [_tool_call(c) for c in history], self.policy)
            paths.setdefault(chain.root, [])
            for step in chain.steps:
                if step.mutates:
                    paths.setdefault(step.state_key, history[: step.position + 1])
        found = []
        for node in nodes:
            path = paths.get(node.anchor_key)
            if path is None or any(c["tool"] in self.nondeterministic for c in [*path, node.call]):
                continue
            result = served(path, node.call)
            if result is None:
                continue
            expected = self._fresh(path, lambda oracle: oracle.execute_observed(node.call)[0])
            if judge(result, expected, cached=True).wrong:
                found.append(
                    f"node {node.node_id} serves {result!r} to every rollout that issues {node.call} after "
                    f"{path}; fresh execution gives {expected!r}"
                )
        for snapshot in snapshots:
            path = paths.get(snapshot.state_key)
            if path is None or any(c["tool"] in self.nondeterministic for c in path):
                continue
            expected = self._fresh(path, lambda oracle: oracle.files())
            if snapshot.files != expected:
                found.append(
                    f"the snapshot of node {snapshot.node_id} holds {snapshot.files!r}; its path {path} "
                    f"leaves {expected!r}"
                )
        return found

    def _fresh(self, path: list[dict], then: Callable[[Oracle], Any]) -> Any:
        """`then` on a fresh sandbox that ran `path`."""
        oracle = self._oracle_factory()
        for c in path:
            oracle.execute_observed(c)
        out = then(oracle)
        oracle.stop()
        return out
