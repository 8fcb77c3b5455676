"""Writes to the tool call graphs. Plain functions named <entity>_<action>."""

from .audit import divergence_record, node_audit
from .flight import Flight, looked
from .lookup import (
    LookupHit,
    LookupMiss,
    claim_release,
    history_catch_up,
    history_resume,
    hit_count,
    lease_grant,
    lookup_count,
    replay_file_times,
    tcg_lookup,
    tcg_lookup_in_memory,
)
from .maintenance import claims_clear, indexes_rebuild, tables_vacuum
from .nodes import nodes_delete
from .record import RecordOutcome, node_record
from .retention import rollouts_expire, task_enforce_retention, tasks_enforce_retention
from .rollouts import (
    KeptAppend,
    RolloutClaim,
    kept_digests,
    kept_history,
    rollout_claim,
    rollout_detach,
    rollout_history_append,
    rollout_unclaim,
)
from .snapshots import backend_costs, lease_release, snapshot_evict, snapshot_register, task_enforce_budget
from .tasks import TaskHandle, task_flush, task_handle, task_put
from .trees import tree_export

__all__ = [
    "Flight",
    "KeptAppend",
    "LookupHit",
    "LookupMiss",
    "RecordOutcome",
    "RolloutClaim",
    "TaskHandle",
    "claim_release",
    "divergence_record",
    "history_catch_up",
    "history_resume",
    "lease_grant",
    "node_audit",
    "backend_costs",
    "lease_release",
    "hit_count",
    "lookup_count",
    "node_record",
    "nodes_delete",
    "task_enforce_retention",
    "tasks_enforce_retention",
    "rollouts_expire",
    "rollout_claim",
    "kept_digests",
    "kept_history",
    "rollout_detach",
    "rollout_history_append",
    "rollout_unclaim",
    "looked",
    "snapshot_evict",
    "snapshot_register",
    "task_enforce_budget",
    "task_flush",
    "task_handle",
    "task_put",
    "tables_vacuum",
    "indexes_rebuild",
    "claims_clear",
    "tcg_lookup",
    "tcg_lookup_in_memory",
    "replay_file_times",
    "tree_export",
]

# Staff actions, each audited (dashboard controls and Django admin actions call these).
from .admin import (  # noqa: E402
    admin_budget_set,
    admin_node_pin,
    admin_snapshot_evict,
    admin_subtree_evict,
    admin_task_flush,
)

__all__ += [
    "admin_budget_set",
    "admin_node_pin",
    "admin_snapshot_evict",
    "admin_subtree_evict",
    "admin_task_flush",
]
