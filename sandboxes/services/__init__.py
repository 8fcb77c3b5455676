"""Managed sandboxes: pools and pre-forks, tool-server mode, and reaping. Written against the
backend interface (`sandboxes.backends.base`), never against one backend."""

from .audit import hit_audit, hit_audit_enqueue
from .branches import branches_open
from .pools import admin_sandbox_stop, pool_request, sandbox_acquire, sandbox_stop, sandbox_warm, step_announce
from .reaper import orphans_reap, sandboxes_reap, sandboxes_release, snapshots_collect, tasks_release
from .toolserver import CallOutcome, rollout_call, rollout_end, rollout_ran_last, rollout_ran_note

__all__ = [
    "CallOutcome",
    "admin_sandbox_stop",
    "branches_open",
    "hit_audit",
    "hit_audit_enqueue",
    "orphans_reap",
    "pool_request",
    "rollout_call",
    "rollout_end",
    "rollout_ran_last",
    "rollout_ran_note",
    "sandbox_acquire",
    "sandbox_stop",
    "sandbox_warm",
    "sandboxes_reap",
    "sandboxes_release",
    "snapshots_collect",
    "step_announce",
    "tasks_release",
]
