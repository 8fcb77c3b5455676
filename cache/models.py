"""The tool call graphs in PostgreSQL. Keys and their meaning come from `cache.tcg`."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models import Q
from django.utils import timezone

from accounts.models import Project
from accounts.projects import MAX_TASK_ID, MAX_TASK_KEY
from cache.tcg.exectimes import BUCKETS


class DigestField(models.Field):
    """A SHA-256 digest (a key of cache.tcg): 64 hex characters in Python, its 32 bytes in
    PostgreSQL (bytea: half the room of the text in rows and indexes). Raw SQL sends and reads
    the hex: decode(%s, 'hex'), encode(column, 'hex')."""

    description = "SHA-256 digest"

    def db_type(self, connection) -> str:
        return "bytea"

    def get_prep_value(self, value):
        if value is None or isinstance(value, bytes):
            return value
        return bytes.fromhex(value)

    def from_db_value(self, value, expression, connection):
        return None if value is None else bytes(value).hex()

    def to_python(self, value):
        return bytes(value).hex() if isinstance(value, (bytes, memoryview)) else value


class Task(models.Model):
    # The internal key: the task's id in the default project, "<project>.<id>" in another one
    # (accounts.projects.task_key); the API speaks `name`, the id its project knows it by.
    id = models.CharField(primary_key=True, max_length=MAX_TASK_KEY)
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="tasks")
    name = models.SlugField(max_length=MAX_TASK_ID, db_index=False)
    env = models.JSONField()
    env_fingerprint = models.CharField(max_length=64)
    tools = models.JSONField(default=dict)  # {name: {"mutates_state": bool, "cacheable": bool}}
    sandbox_budget = models.PositiveIntegerField()
    # Determinism audit: the fraction of hits re-executed and compared (`Divergence`), and the
    # tools the audit made uncacheable here (more than TVCACHE_AUDIT_MAX_DIVERGENT divergent nodes).
    audit_rate = models.FloatField(default=0.02)
    uncacheable_tools = models.JSONField(default=list)
    version = models.PositiveIntegerField(default=1)  # bumped by every update; hot paths check it
    # Retention (docs/operations/retention.md): the nodes and result bytes the task keeps at most;
    # the periodic job evicts its coldest subtrees beyond them. NULL: the project's default
    # (Project.task_max_nodes, task_max_result_bytes), and if that is NULL too, unbounded.
    max_nodes = models.PositiveIntegerField(null=True, blank=True)
    max_result_bytes = models.PositiveBigIntegerField(null=True, blank=True)

    class Match(models.TextChoices):
        # Longest-prefix matching: a hit needs the rollout's history of state-changing calls.
        HISTORY = "history"
        # Also state-keyed hits: a call seen before in a state with the same verified fingerprint
        # (docs/design/state-match.md).
        STATE = "state"

    match = models.CharField(max_length=8, choices=Match.choices, default=Match.HISTORY, db_default=Match.HISTORY)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="task_unique_name")]

    def __str__(self) -> str:
        return self.id


class Node(models.Model):
    """One executed tool call with its result, under (anchor state key, call digest)."""

    # No index of its own: `node_task_depth` (task, depth, id) serves every read by task.
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="nodes", db_index=False)
    anchor_key = DigestField()
    call_digest = DigestField()
    state_key = DigestField()  # state after the call (= anchor for read-only)
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.CASCADE, related_name="children")
    depth = models.PositiveIntegerField()
    tool = models.CharField(max_length=200)
    call = models.JSONField()
    mutates = models.BooleanField()
    result_json = models.TextField()  # as recorded, keys in the tool's order; served as is
    result_bytes = models.PositiveIntegerField()
    exec_ms = models.FloatField()
    cum_exec_ms = models.FloatField()  # exec time of the state-changing path from the root
    # The sandbox's StateFingerprint right after the call first ran (tool-server mode, state-changing
    # calls): a sandbox materialized for this node must match it before a call runs in it.
    state_fingerprint = models.CharField(max_length=64, blank=True, default="", db_default="")  # StateDigest.full
    state_shape = models.CharField(max_length=64, blank=True, default="", db_default="")  # StateDigest.shape (replays)
    state_order = models.CharField(
        max_length=64, blank=True, default="", db_default=""
    )  # StateDigest.order (replays with times)
    # The modification times (ns, by path) of what the call changed when it first ran: a replay
    # of the call writes them back, so file times (make, bytecode caches) are as the live run's.
    # NULL: not kept (too many, or not observed); a replay restores times only up to such a call.
    file_times = models.JSONField(null=True, blank=True)
    # How many processes the sandbox kept running after the call first ran (tool-server mode; the
    # service's own left out): such a state is materialized only from the rollout's own sandbox, a
    # snapshot that keeps processes, or a replay that starts them again (docs/design/state.md).
    live_processes = models.PositiveIntegerField(default=0, db_default=0)  # record.py inserts raw rows
    hit_count = models.PositiveIntegerField(default=0)
    last_hit_at = models.DateTimeField(null=True, blank=True)
    first_rollout_id = models.CharField(max_length=200, blank=True, default="")
    first_epoch = models.IntegerField(null=True, blank=True)
    pinned = models.BooleanField(default=False)
    # A re-execution of the call at its parent state gave another result: the node is no longer
    # served (its lookups answer as misses).
    divergent = models.BooleanField(default=False, db_default=False)  # record.py inserts raw rows
    # A state-keyed hit's node (docs/design/state-match.md): the call was not executed under this
    # history; its result, and the state it left, are those of the node it names (the executed
    # one), reached from a state with the same verified fingerprint. Not a key: that node may be
    # evicted, and this one keeps its own copy of everything it serves.
    merged_from = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["task", "anchor_key", "call_digest"], name="node_unique_key"),
        ]
        indexes = [
            models.Index(fields=["task", "state_key"], condition=Q(mutates=True), name="node_write_state"),
            # The graph page's first levels, in order (depth, id), read as an index range.
            models.Index(fields=["task", "depth", "id"], name="node_task_depth_id"),
            # Lookups check that no divergent state-changing node lies on the history (lookup.py).
            models.Index(
                fields=["task", "state_key"], condition=Q(mutates=True, divergent=True), name="node_divergent_state"
            ),
            # State-keyed lookups find the states with a fingerprint (lookup.py, STATE_PROBE_SQL).
            models.Index(
                fields=["task", "state_fingerprint"],
                condition=Q(mutates=True) & ~Q(state_fingerprint=""),
                name="node_state_identity",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.task_id}#{self.pk} {self.tool}"


class TaskTotal(models.Model):
    """What a task's graph holds, per tool: kept exact as nodes are recorded, removed and marked
    divergent (cache.services.totals, the one place that adjusts them), so stats and pages read a
    row per tool instead of scanning the task's nodes (docs/operations/growth.md)."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="totals", db_index=False)
    tool = models.CharField(max_length=200)
    nodes = models.BigIntegerField(default=0)
    roots = models.BigIntegerField(default=0)  # nodes with no parent: the graph's top level
    result_bytes = models.BigIntegerField(default=0)
    process_states = models.BigIntegerField(default=0)  # state-changing nodes that left live processes
    divergent = models.BigIntegerField(default=0)  # nodes no longer served (Node.divergent)
    # Nodes per bucket of exec time (cache.tcg.exectimes): the median without a sort of every node.
    exec_ms_buckets = ArrayField(models.IntegerField(), size=BUCKETS)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["task", "tool"], name="tasktotal_unique")]


class SnapshotTotal(models.Model):
    """A task's snapshots per backend: live ones and their bytes, evicted ones. Kept by triggers on
    cache_snapshot (migration 0022), which see every change, the cascades of deleted nodes and
    tasks and bulk COPY included; so stats and the pools pages read a row per task and backend
    instead of every live snapshot (docs/operations/growth.md)."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="snapshot_totals", db_index=False)
    backend = models.CharField(max_length=40)
    live = models.BigIntegerField(default=0)
    live_bytes = models.BigIntegerField(default=0)  # of the live ones whose size is known
    live_processes = models.BigIntegerField(default=0)  # live ones that keep the sandbox's processes
    evicted = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["task", "backend"], name="snapshottotal_unique")]


class RolloutTotal(models.Model):
    """A task's rollouts, counted. Kept by triggers on cache_rollout (migration 0024), which see every
    insert and delete (a claim's, a counter flush's, a branch's, a task's delete cascading), so that
    stats read a row instead of counting every rollout of the task (docs/operations/growth.md).
    `expired` counts the rollouts whose rows the history's retention deleted (cache/services/
    retention.py): stats count them still (what a task ran is history)."""

    task = models.OneToOneField(Task, on_delete=models.CASCADE, primary_key=True, related_name="rollout_total")
    rollouts = models.BigIntegerField(default=0)
    expired = models.BigIntegerField(default=0, db_default=0)


class Snapshot(models.Model):
    class Status(models.TextChoices):
        LIVE = "live"
        EVICTED = "evicted"  # no longer offered; a service-owned one still holds backend storage
        DELETED = "deleted"  # its backend storage is gone too

    class Owner(models.TextChoices):
        CLIENT = "client"  # taken and kept by a trainer (client mode)
        SERVICE = "service"  # a sandbox snapshot the service manages

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="snapshots")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="snapshots")
    backend = models.CharField(max_length=40)
    # The docker engine holding a service snapshot's image, where its forks run (as Sandbox.engine).
    engine = models.CharField(max_length=200, blank=True, default="")
    ref = models.CharField(max_length=300)
    owner = models.CharField(max_length=10, choices=Owner.choices, default=Owner.CLIENT)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.LIVE)
    size_bytes = models.BigIntegerField(null=True, blank=True)
    create_ms = models.FloatField(null=True, blank=True)
    # It holds the sandbox's processes and memory (a checkpoint), not only its files: only such a
    # snapshot is forked for a state with live processes.
    keeps_processes = models.BooleanField(default=False, db_default=False)
    # A copy of the state its node's call left (taken right after it ran); False for one taken of a
    # replayed sandbox (a branch point's), which matches the node's state only up to the order of
    # file times: its bare forks are verified as replays are.
    exact = models.BooleanField(default=True, db_default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    evicted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["task", "ref"], name="snapshot_unique_ref"),
            models.UniqueConstraint(fields=["node"], condition=Q(status="live"), name="snapshot_one_live_per_node"),
        ]
        indexes = [
            # A task's live snapshots newest first (its pools page), whether it has any (the pools
            # list), and their counts, bytes, backends and newest (stats, lists): an index range
            # read alone, not a sort or a heap read of every live snapshot.
            models.Index(
                fields=["task", "created_at", "id"],
                include=["size_bytes", "backend", "keeps_processes"],
                condition=Q(status="live"),
                name="snapshot_live_task",
            ),
            models.Index(fields=["task"], condition=Q(status="evicted"), name="snapshot_evicted_task"),
        ]


class Divergence(models.Model):
    """A result or state that differed from what a node recorded."""

    class Kind(models.TextChoices):
        AUDIT = "audit"  # a sampled hit, re-executed at its parent state, gave another result
        STATE = "state"  # a sandbox materialized for the node is not in the state the node recorded
        # The state the node's call left kept changing after the call returned (a process it started
        # writes files): it depends on timing, so the node is no longer served (as an audit's).
        DRIFT = "drift"

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="divergences")
    # Kept when the node is evicted with its subtree: the divergence happened all the same.
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="divergences")
    tool = models.CharField(max_length=200)
    kind = models.CharField(max_length=10, choices=Kind.choices)
    expected = models.JSONField(null=True)
    observed = models.JSONField(null=True)
    rollout_id = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["task", "tool"], name="divergence_task_tool")]


class MergeBan(models.Model):
    """A state fingerprint whose state-keyed hits stopped: the audit found a call from a state
    with it giving another result (docs/design/state-match.md). Lookups from such a state go back
    to history keys; the nodes merged at it are no longer served."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="merge_bans")
    fingerprint = models.CharField(max_length=64)
    node_id = models.BigIntegerField(null=True)  # the divergent node that stopped it
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["task", "fingerprint"], name="mergeban_unique")]


class Lease(models.Model):
    """A reference a resuming rollout holds on a snapshot; eviction never touches a leased one."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    snapshot = models.ForeignKey(Snapshot, on_delete=models.CASCADE, related_name="leases")
    rollout_id = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    released_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["snapshot"], condition=Q(released_at__isnull=True), name="lease_open")]


class Claim(models.Model):
    """A rollout executing a call it missed on (client-mode single flight): other rollouts that
    miss on the same call in the same state wait for its record instead of executing it too.
    Ephemeral: the table is UNLOGGED (no WAL, emptied by a crash), a record makes the claim on its
    node lapse shortly, a claim its holder never recorded lapses at `expires_at`, and workers
    delete lapsed claims. No foreign key: an
    unlogged table may not be referenced, and a claim outlives nothing it names."""

    task_id = models.CharField(max_length=MAX_TASK_KEY)
    anchor_key = models.CharField(max_length=64)
    call_digest = models.CharField(max_length=64)
    holder = models.CharField(max_length=200)  # the rollout id
    expires_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["task_id", "anchor_key", "call_digest"], name="claim_key")]


class BackendCost(models.Model):
    """Moving averages of snapshot and restore costs per backend (selective snapshotting)."""

    backend = models.CharField(max_length=40, primary_key=True)
    snapshot_ms = models.FloatField()
    restore_ms = models.FloatField()
    snapshot_samples = models.PositiveIntegerField(default=0)
    restore_samples = models.PositiveIntegerField(default=0)


class Rollout(models.Model):
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="rollouts")
    rollout_id = models.CharField(max_length=200)
    epoch = models.IntegerField(default=0)
    calls = models.PositiveIntegerField(default=0)
    hits = models.PositiveIntegerField(default=0)
    # Tool-server mode keeps the rollout's state-changing calls: how many, and each a RolloutCall.
    history_length = models.PositiveIntegerField(default=0, db_default=0)
    started_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Known-state rule: after a call that timed out, was killed or after which the backend failed,
    # the rollout's state is unknown. It leaves the shared graph: its later calls run in its own
    # sandbox, uncached and unrecorded (docs/design/guarantees.md).
    detached_at = models.DateTimeField(null=True, blank=True)
    detached_reason = models.TextField(blank=True, default="", db_default="")
    # A branch continues another rollout after `branch_step` calls of its history (or starts at a
    # node: `branch_node`); both empty for a rollout started from the task's root.
    branch_of = models.CharField(max_length=200, blank=True, default="", db_default="")
    branch_step = models.PositiveIntegerField(null=True, blank=True)
    branch_node = models.BigIntegerField(null=True, blank=True)  # not a key: the node may be evicted
    # What the trainer said of it (cache.tcg.records.Trace): its trajectory, and the span of its
    # origin's tokens a branch shares ({"prompt": [0, n]}). Returned by the tree export.
    trajectory_ref = models.CharField(max_length=1000, blank=True, default="", db_default="")
    branch_tokens = models.JSONField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["task", "rollout_id"], name="rollout_unique")]
        indexes = [
            # The task page's rollouts, latest first, a page at a time.
            models.Index(fields=["task", "started_at", "id"], name="rollout_task_started"),
            # The history's retention: the oldest rollouts of every task.
            models.Index(fields=["started_at"], name="rollout_started"),
        ]


class RolloutCall(models.Model):
    """The state-changing call at `position` (from 0) of a rollout's kept history, written once when
    it joins the history and never changed (cache/services/rollouts.py): a call appends one row,
    however long the history, where a history kept in one column was written whole on every call."""

    pk = models.CompositePrimaryKey("rollout_id", "position")
    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="kept_calls", db_index=False)
    position = models.PositiveIntegerField()
    call = models.JSONField()


class RolloutStep(models.Model):
    """A call a rollout was answered, in the graph: served from `node_id` (a hit) or recorded as it
    (a miss). The rollout's path for the tree export (cache/services/trees.py), written by the
    ledger in batches like every counter (cache/ledger.py). Calls a detached rollout ran outside
    the graph and replays that only rebuilt a sandbox are not steps."""

    id = models.BigAutoField(primary_key=True)
    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="steps", db_index=False)
    # Order: the state-changing calls before it, then the trainer's `seq`, then when it was answered.
    applied = models.PositiveIntegerField()
    seq = models.PositiveIntegerField(null=True, blank=True)
    at = models.BigIntegerField()  # ns since the Unix epoch
    node_id = models.BigIntegerField()  # not a key: the node may be evicted
    hit = models.BooleanField()
    tokens = models.JSONField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["rollout", "applied", "seq", "at"], name="rolloutstep_order")]


class MaterializationStat(models.Model):
    """How tool-server misses got their sandbox to their history's state, per task, and whether that
    state had live processes (Node.live_processes), counted by the ledger: the rollout's own sandbox,
    a ready pre-fork or a fork of a snapshot (a checkpoint: it kept the processes), a root and a
    replay, a fresh root after another sandbox diverged, or none (the call ran uncached)."""

    class How(models.TextChoices):
        OWN = "own", "its own sandbox, caught up"
        PREFORK = "prefork", "a ready fork of a snapshot"
        FORK = "fork", "a fork of a snapshot"
        CHECKPOINT = "checkpoint", "a fork of a snapshot keeping processes"
        ROOT = "root", "a fresh sandbox and a replay"
        REBUILT = "rebuilt", "a replay from the root after a divergence"
        UNCACHED = "uncached", "none: the call ran uncached"

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="materializations")
    how = models.CharField(max_length=12, choices=How.choices)
    processes = models.BooleanField()  # the state reached had live processes
    count = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["task", "how", "processes"], name="materialization_unique")]


class ToolStat(models.Model):
    """Counters per task, epoch and tool; task and epoch figures are sums of these rows."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="tool_stats")
    epoch = models.IntegerField()
    tool = models.CharField(max_length=200)
    calls = models.PositiveIntegerField(default=0)
    hits = models.PositiveIntegerField(default=0)
    oracle_hits = models.PositiveIntegerField(default=0)
    # State-keyed hits (of `hits`), and the state oracle: calls whose state and call were seen
    # before, by history or by a verified fingerprint (of `calls`; docs/design/state-match.md).
    state_hits = models.PositiveIntegerField(default=0, db_default=0)
    state_oracle_hits = models.PositiveIntegerField(default=0, db_default=0)
    executions = models.PositiveIntegerField(default=0)
    executed_ms = models.FloatField(default=0.0)
    saved_ms = models.FloatField(default=0.0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["task", "epoch", "tool"], name="toolstat_unique")]


class AuditEntry(models.Model):
    """The audit log of staff and maintainer actions (evictions, pins, flushes, budgets, sandbox
    stops, task changes) and of what the service decides on its own (a tool the determinism audit
    made uncacheable). Written by the services that act (cache.services.admin), read by the
    dashboard. (The dashboard app's once: the table moved with its rows, migration 0011.)"""

    class Action(models.TextChoices):
        SUBTREE_EVICT = "subtree_evict", "Evict subtree"
        SNAPSHOT_EVICT = "snapshot_evict", "Evict snapshot"
        NODE_PIN = "node_pin", "Pin node"
        NODE_UNPIN = "node_unpin", "Unpin node"
        TASK_FLUSH = "task_flush", "Flush task"
        BUDGET_SET = "budget_set", "Set budget"
        SANDBOX_STOP = "sandbox_stop", "Stop sandbox"
        TOOL_UNCACHEABLE = "tool_uncacheable", "Tool made uncacheable (audit)"
        TASK_UPDATE = "task_update", "Change task (env, tools, budget)"

    class Outcome(models.TextChoices):
        OK = "ok"
        REFUSED = "refused"  # the service declined (unknown node, leased snapshot, bad budget...)
        FAILED = "failed"  # an unexpected error

    at = models.DateTimeField(default=timezone.now, db_index=True)
    # The name is kept apart from the foreign key so the log still says who after a user is deleted.
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_name = models.CharField(max_length=150)  # a user's name, or "token:<name>" for an API token
    action = models.CharField(max_length=40, choices=Action.choices)
    # The task's key (accounts.projects.task_key); no FK: the entry survives the task.
    task_id = models.CharField(max_length=MAX_TASK_KEY, blank=True, default="", db_index=True)
    # Whose log it is: members see their projects' entries.
    project = models.ForeignKey(Project, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    target = models.CharField(max_length=300)
    outcome = models.CharField(max_length=10, choices=Outcome.choices)
    details = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor_name} {self.action} {self.target}: {self.outcome}"
