"""The exactness referee: what a wrong hit, a wrong miss and the oracle are, for the replays and
for the property tests (tests/cache/exactness.py drives it against the store, in tool-server and
client mode).

- A cached answer, hit or miss, is judged against a fresh execution of the same history (`judge`):
  one that differs is wrong (a wrong hit, a wrong miss), unless a further fresh execution of the
  history gives it too: then the history has two live outcomes and the answer counts as
  nondeterministic, apart from the wrong ones.
- The oracle is the cache that hits exactly when an earlier call had the same anchor state key and
  call digest, keyed as the service keys them (cache.tcg): `call_keys` for a replay's calls (the
  issued oracle of report.py counts from them), the pure `ToolCallGraph` for a scenario's steps.

    verdict.py   `judge`: a cached answer against fresh execution (the one definition)
    replays.py   `ReplayReferee`: every cached call of a replay's epoch against the no-cache arm,
                 which ran each rollout's exact history in a fresh sandbox (the policies are open
                 loop), the mismatches tried again at other paces (docs/lab/replays.md#exactness);
                 `call_keys`, the oracle's keys
    scenarios.py `Referee`: a property test's scenario step by step, with a fresh sandbox per
                 rollout and the pure graph; the meaning of each of its properties is on the class
"""

from .replays import EXACT_KEYS, REPRODUCE_TRIES, ReplayReferee, call_keys
from .scenarios import Oracle, Outcome, Referee, Step, StoredNode, StoredSnapshot
from .verdict import Verdict, judge

__all__ = [
    "EXACT_KEYS",
    "REPRODUCE_TRIES",
    "Oracle",
    "Outcome",
    "Referee",
    "ReplayReferee",
    "Step",
    "StoredNode",
    "StoredSnapshot",
    "Verdict",
    "call_keys",
    "judge",
]
