"""tvclient: the trainer-side library of tvcache, the stateful tool-value cache."""

from .client import AsyncTVCacheClient, TaskSpec, TVCacheClient
from .environment import ToolExecutionEnvironment
from .envs import FolderEnvironment, InMemoryEnvironment, UnknownTool
from .errors import TVCacheError, TVCacheUnavailable
from .executor import AsyncToolCallExecutor, ReplayFailed, ToolCallExecutor
from .results import (
    Call,
    CallResult,
    LookupResult,
    RecordResult,
    Resume,
    SnapshotRegistration,
    ToolResult,
    inexact_json,
)
from .retry import RetryPolicy
from .snapshots import SnapshotStore

__all__ = [
    "AsyncTVCacheClient",
    "AsyncToolCallExecutor",
    "Call",
    "CallResult",
    "FolderEnvironment",
    "InMemoryEnvironment",
    "LookupResult",
    "RecordResult",
    "Resume",
    "RetryPolicy",
    "SnapshotRegistration",
    "SnapshotStore",
    "TaskSpec",
    "TVCacheClient",
    "TVCacheError",
    "TVCacheUnavailable",
    "ReplayFailed",
    "ToolCallExecutor",
    "ToolExecutionEnvironment",
    "ToolResult",
    "UnknownTool",
    "inexact_json",
]
