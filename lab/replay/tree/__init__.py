"""The tree-search replay (`manage.py replay_tree`): the terminal or sql workload's rollouts run as
trees, each trajectory branching into continuations at a step, in three arms: no cache (each branch
replays its prefix in a fresh sandbox), tool-server mode (POST .../branches) and client mode
(ToolCallExecutor.branch); every answer is checked against a fresh execution of its own full
history, and the report adds branch readiness and trajectories per sandbox-second
(docs/lab/tree-search-replay.md).

    plan.py      the trees: roots, branch points, seeded continuations
    drivers.py   how each arm runs a trajectory and opens its branches
    harness.py   TreeReplay: the epoch loop, the trajectories in flight, the exactness check
    samples.py   what is measured of branch points, branches and epochs
    meters.py    sandbox-seconds: local lifetimes, the service's live sandboxes
    report.py    the report's `tree` figures and their tables
"""

from .harness import TreeConfig, TreeReplay
from .plan import Trajectory, TreePlans, TreeShape
from .report import tree_headline, tree_report

__all__ = [
    "TreeConfig",
    "TreePlans",
    "TreeReplay",
    "TreeShape",
    "Trajectory",
    "tree_headline",
    "tree_report",
]
