"""The pure tool-call-graph core: keys, longest-prefix match, snapshot and eviction policy.

Imports nothing from Django, DRF, Celery, Channels or docker (an import-linter contract and a
test keep it so). Everything the service stores is derived from these functions.
"""

from .keys import (
    ToolCall,
    call_digest,
    canonical_call,
    canonical_json,
    env_fingerprint,
    next_state_key,
    result_json,
    root_state_key,
    same_result,
)
from .match import (
    CatchUp,
    ChainStep,
    Match,
    NodeRef,
    RecordPlan,
    StateChain,
    catch_up,
    chain_extended,
    longest_prefix_match,
    record_plan,
    state_chain,
)
from .policy import TaskPolicy, ToolPolicy
from .records import RecordedState

__all__ = [
    "RecordedState",
    "CatchUp",
    "ChainStep",
    "StateChain",
    "canonical_json",
    "catch_up",
    "chain_extended",
    "Match",
    "NodeRef",
    "RecordPlan",
    "TaskPolicy",
    "ToolCall",
    "ToolPolicy",
    "call_digest",
    "canonical_call",
    "env_fingerprint",
    "longest_prefix_match",
    "next_state_key",
    "record_plan",
    "result_json",
    "root_state_key",
    "same_result",
    "state_chain",
]
