"""The rollout protocol, written once: what one call of a rollout does next, as a state machine
without I/O. It decides; its drivers do the work. Tool-server mode (sandboxes/services/toolserver.py)
and the verl-tool proxy (upstreams/services/proxy.py) drive it against the database and a sandbox
or an upstream; tvclient's executor takes the same steps on the trainer's side.

The steps of a call `c` of a rollout with history `H` (the calls that changed its state):

1. A detached rollout (known-state rule) runs `c` as it is: uncached, unrecorded.
2. Look `c` up after `H`. A hit is served; if its call changes state, `c` joins `H` (the rollout's
   environment is then a call behind, and catches up before it executes anything).
3. A miss runs the tool. On a lane that serves hits the request moves to the exec lane now,
   before it has taken a lease or a claim, or run anything.
4. Single flight: a miss of a cacheable call not seen before leads its (state, call), or waits
   while another rollout leads it and then looks `c` up again (a hit, most often). A waiter that
   waited its limit executes alongside the leader (twice, never wrongly).
5. The leader brings its environment to `H` (catch-up) and executes `c`.
6. Known-state rule: a call whose effects are unknown (it timed out or was killed, a tool failed
   part way, the state keeps changing on its own) is not recorded and the rollout detaches. An
   environment that failed under the call (not the call itself) is retired instead where the
   driver can rebuild the state from `H` (a sandbox the service owns): the rollout goes on.
   Otherwise the rollout detaches there too. A call refused before it ran changed nothing.
7. Otherwise `c` is recorded under `H`, and joins `H` if it changed the state; the rollouts
   waiting for it are let go.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

log = logging.getLogger("tvcache.rollout")


class Act(enum.Enum):
    """What the driver does next."""

    LOOKUP = "lookup"  # look the call up after the history
    SERVE = "serve"  # answer the hit (`append`: the call joins the history)
    MOVE = "move"  # hand the request to the exec lane, nothing started
    LEAD = "lead"  # try to take the single-flight claim of (state, call)
    AWAIT = "await"  # another rollout leads: wait for its claim, then report `awaited`
    EXECUTE = "execute"  # bring the environment to the history, run the call, report `executed`
    RUN_AS_IS = "run_as_is"  # run the call in the rollout's environment as it is: uncached, unrecorded
    RECORD = "record"  # record the result under the history, then report `recorded`
    DETACH = "detach"  # take the rollout off the shared graph (`reason`); the answer stands
    RETIRE = "retire"  # drop the environment; the rollout goes on from its history
    DONE = "done"  # answered (`append`: the call joins the history)


class Ran(enum.Enum):
    """How an execution ended, as the driver observed it."""

    KNOWN = "known"  # the call ran and the state it left is known
    REFUSED = "refused"  # refused before it ran (no such tool, bad arguments): nothing changed
    UNKNOWN = "unknown"  # the call's own effects are unknown: timed out, killed, failed part way, drifting
    ENV_FAILED = "env_failed"  # the environment failed once the call may have run


@dataclass(frozen=True, slots=True)
class Step:
    act: Act
    append: bool = False
    key: tuple | None = None  # the single-flight claim (LEAD, AWAIT)
    reason: str = ""  # why (DETACH, RETIRE)


@dataclass(frozen=True, slots=True)
class Looked:
    """A lookup's answer as the protocol needs it."""

    hit: bool
    mutates: bool = False  # a hit's call changes state
    flight_key: tuple | None = None  # a miss that single flight coordinates (None: a call not cacheable, or seen)


@dataclass
class RolloutCall:
    """One call of one rollout. `fast_lane`: the driver serves hits on a lane where no tool may run.
    `may_wait`: the driver may still wait for another rollout's claim (a request past its wait
    limit executes alongside). `rebuilds`: the driver can rebuild the rollout's state from its
    history in a fresh environment. `trace` lists the acts taken, in order."""

    detached: bool
    fast_lane: bool = False
    may_wait: bool = True
    rebuilds: bool = False
    leading: bool = False
    trace: list[str] = field(default_factory=list)

    def start(self, *, servable: bool = True) -> Step:
        """`servable`: the call may be answered from the graph (a call the driver can only pass
        on, such as an action no tool parses, is executed and recorded, never looked up)."""
        if self.detached:
            return self._step(Act.MOVE if self.fast_lane else Act.RUN_AS_IS)
        if not servable:
            return self._step(Act.MOVE if self.fast_lane else Act.EXECUTE)
        return self._step(Act.LOOKUP)

    def looked_up(self, answer: Looked) -> Step:
        if answer.hit:
            return self._step(Act.SERVE, append=answer.mutates)
        if self.fast_lane:
            return self._step(Act.MOVE)
        if self.leading or answer.flight_key is None:
            return self._step(Act.EXECUTE)
        return self._step(Act.LEAD, key=answer.flight_key)

    def lead_tried(self, led: bool, key: tuple) -> Step:
        """`led`: the claim is this rollout's now, or its leader recorded the call meanwhile."""
        if led:
            self.leading = True
            return self._step(Act.EXECUTE)
        if self.may_wait:
            return self._step(Act.AWAIT, key=key)
        return self._step(Act.EXECUTE)  # waited its limit: alongside the leader

    def awaited(self, *, timed_out: bool) -> Step:
        """The claim is free (this rollout may lead now) or the leader recorded the call: look it
        up again. `timed_out`: the leader kept it too long, execute alongside."""
        if timed_out:
            return self._step(Act.EXECUTE)
        self.leading = True
        return self._step(Act.LOOKUP)

    def executed(self, ran: Ran, *, reason: str = "") -> Step:
        if ran is Ran.KNOWN:
            return self._step(Act.RECORD)
        if ran is Ran.REFUSED:
            return self._step(Act.DONE)
        if ran is Ran.ENV_FAILED and self.rebuilds:
            return self._step(Act.RETIRE, reason=reason)
        return self._step(Act.DETACH, reason=reason)

    def recorded(self, *, mutates: bool) -> Step:
        return self._step(Act.DONE, append=mutates)

    def logged(self, rollout_id: str) -> None:
        """The acts taken, in the log (debug): how each call was served."""
        log.debug("rollout %s: %s", rollout_id, " > ".join(self.trace))

    def _step(self, act: Act, *, append: bool = False, key: tuple | None = None, reason: str = "") -> Step:
        self.trace.append(act.value)
        return Step(act, append, key, reason)
