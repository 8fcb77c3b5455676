"""Input and output shapes of the API: the OpenAPI schema, and the validation of the cold endpoints
whose bodies cache/inputs.py does not parse. A body that a `cache.inputs.parse_<body>` parses is
described here and validated there only; tests/cache/test_schema_inputs.py checks that the two
say the same."""

from rest_framework import serializers

from cache.inputs import (
    MAX_FILE_TIMES,
    MAX_FILE_TIMES_PATHS,
    MAX_MS,
    MAX_PATH_LENGTH,
    MAX_SNAPSHOT_BYTES,
    MAX_TRAJECTORY_REF,
)
from core.inputs import INT32, INT64, MAX_ID_LENGTH


class ToolCallSerializer(serializers.Serializer):
    tool = serializers.CharField(min_length=1, max_length=MAX_ID_LENGTH)
    args = serializers.DictField(default=dict)


class ToolPolicySerializer(serializers.Serializer):
    mutates_state = serializers.BooleanField(default=True)
    cacheable = serializers.BooleanField(default=True)


class TaskPutSerializer(serializers.Serializer):
    env = serializers.DictField(help_text='{"backend": "docker"|"directory"|"sqlite"|"external", ...}')
    tools = serializers.DictField(child=ToolPolicySerializer(), required=False)
    sandbox_budget = serializers.IntegerField(min_value=0, max_value=INT32[1], required=False)
    audit_rate = serializers.FloatField(
        min_value=0.0,
        max_value=1.0,
        required=False,
        help_text=(
            "Determinism audit: the fraction of hits re-executed at their parent state and compared (default 0.02; "
            "0 turns it off). Changing it keeps the graph."
        ),
    )
    match = serializers.ChoiceField(
        choices=["history", "state"],
        required=False,
        help_text=(
            '"history": a hit needs the rollout\'s history of state-changing calls (longest-prefix matching). '
            '"state": also a call seen before from a state with the same verified fingerprint. Left out: the '
            "task's (a new task: TVCACHE_DEFAULT_MATCH). Changing it keeps the graph."
        ),
    )
    max_nodes = serializers.IntegerField(
        min_value=0,
        max_value=INT32[1],
        required=False,
        allow_null=True,
        help_text=(
            "Retention: the nodes the task keeps at most; its coldest subtrees beyond are evicted (their lookups "
            "miss, their stats stay). null: the project's default (none: unbounded); left out: unchanged."
        ),
    )
    max_result_bytes = serializers.IntegerField(
        min_value=0,
        max_value=INT64[1],
        required=False,
        allow_null=True,
        help_text="Retention: the bytes of results the task keeps at most (as max_nodes).",
    )


class TaskSerializer(serializers.Serializer):
    id = serializers.CharField(source="name", help_text="The task's id in its project (the token's).")
    env = serializers.DictField()
    env_fingerprint = serializers.CharField()
    tools = serializers.DictField()
    sandbox_budget = serializers.IntegerField()
    audit_rate = serializers.FloatField()
    match = serializers.CharField()
    max_nodes = serializers.IntegerField(allow_null=True, help_text="null: the project's default")
    max_result_bytes = serializers.IntegerField(allow_null=True, help_text="null: the project's default")
    uncacheable_tools = serializers.ListField(
        child=serializers.CharField(),
        help_text=(
            "Tools the determinism audit made uncacheable for this task (more than TVCACHE_AUDIT_MAX_DIVERGENT "
            "divergent nodes); cleared when the task's graph is dropped."
        ),
    )
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()


class TaskListSerializer(serializers.Serializer):
    tasks = TaskSerializer(many=True)  # each with its stats, nodes and live_snapshots
    count = serializers.IntegerField()  # the tasks that match, on every page
    next_offset = serializers.IntegerField(allow_null=True)  # null on the last page


def _span(help_text: str) -> serializers.ListField:
    return serializers.ListField(
        child=serializers.IntegerField(min_value=0, max_value=INT32[1]),
        min_length=2,
        max_length=2,
        required=False,
        help_text=help_text,
    )


class PromptSpanSerializer(serializers.Serializer):
    prompt = _span("[start, end): the tokens of the origin's trajectory a branch shares")


class TokenSpansSerializer(serializers.Serializer):
    prompt = _span("[start, end): the context the model saw when it produced the call")
    completion = _span("[start, end): the tokens it generated, holding the call")


class BranchOfSerializer(serializers.Serializer):
    rollout = serializers.CharField(max_length=MAX_ID_LENGTH)
    step = serializers.IntegerField(min_value=0, max_value=INT32[1], help_text="state-changing calls of its history")
    tokens = PromptSpanSerializer(required=False)


class TraceSerializer(serializers.Serializer):
    """For the rollout tree export (GET /tasks/{id}/tree); nothing here changes an answer."""

    trajectory_ref = serializers.CharField(
        required=False, max_length=MAX_TRAJECTORY_REF, help_text="The trainer's reference of the trajectory (opaque)."
    )
    tokens = TokenSpansSerializer(required=False, help_text="The call's token spans in its trajectory.")
    seq = serializers.IntegerField(
        required=False,
        min_value=0,
        max_value=INT32[1],
        help_text="The call's position among its rollout's calls (orders records sent late).",
    )
    branch_of = BranchOfSerializer(
        required=False, help_text="Client mode: the rollout this one branched from (its first calls say so)."
    )


class CallContextSerializer(TraceSerializer):
    history = ToolCallSerializer(many=True)
    call = ToolCallSerializer()
    rollout_id = serializers.CharField(required=False, max_length=MAX_ID_LENGTH)
    epoch = serializers.IntegerField(required=False, min_value=INT32[0], max_value=INT32[1])
    env_fingerprint = serializers.CharField(
        required=False, help_text="Refuse (409 env_changed) if the task's environment changed."
    )


class LookupSerializer(CallContextSerializer):
    claim = serializers.BooleanField(
        required=False,
        default=False,
        help_text=(
            "Client-mode single flight (needs rollout_id): on a miss of a cacheable call, take the call's claim. "
            "The answer's claim is 'granted' (execute the call and record it; the record ends the claim) or "
            "'in_flight' (another rollout is executing this call in this state: look up again shortly, it turns "
            "into a hit once that rollout records; nothing was counted or leased). A rollout whose execution failed "
            "gives the claim up (POST .../claims/release); a claim neither recorded nor given up lapses after "
            "TVCACHE_CLAIM_TTL_S (60 s)."
        ),
    )
    resume = serializers.BooleanField(
        required=False,
        default=True,
        help_text=(
            "False: the caller's sandbox already follows the history (it will replay what it missed "
            "rather than fork): a miss then offers no snapshot (resume is null) and leases none."
        ),
    )


class ClaimReleaseSerializer(CallContextSerializer):
    rollout_id = serializers.CharField(
        min_length=1, max_length=MAX_ID_LENGTH, help_text="The rollout that holds the claim."
    )


class ClaimReleasedSerializer(serializers.Serializer):
    released = serializers.BooleanField(
        help_text="False: the rollout held no claim on this call (lapsed, or taken over)."
    )


class ResumeSerializer(serializers.Serializer):
    node_id = serializers.IntegerField()
    snapshot_id = serializers.IntegerField()
    snapshot_ref = serializers.CharField()
    lease_id = serializers.UUIDField()
    replay = ToolCallSerializer(many=True)


class LookupResponseSerializer(serializers.Serializer):
    hit = serializers.BooleanField()
    node_id = serializers.IntegerField(required=False, help_text="Hits only.")
    result = serializers.JSONField(required=False, help_text="Hits only.")
    mutates = serializers.BooleanField(
        required=False,
        help_text=(
            "Hits only. False: the call left the state as it was (a read-only tool, or a call observed to change "
            "nothing); a client may then leave it out of the history it sends."
        ),
    )
    matched = serializers.IntegerField(required=False, help_text="Misses: leading history calls whose state is stored.")
    resume = ResumeSerializer(
        required=False, allow_null=True, help_text="Misses: where to fork from; null = fresh sandbox."
    )
    replay = ToolCallSerializer(
        many=True, required=False, help_text="Misses: every state-changing call of the history."
    )
    claim = serializers.ChoiceField(
        choices=["granted", "in_flight"], required=False, help_text="Misses of lookups that asked for a claim."
    )
    snapshot_after_ms = serializers.FloatField(
        required=False,
        allow_null=True,
        help_text=(
            "Misses: if the call changes the state and runs longer than this, its record will most likely answer "
            '"snapshot": "wanted" (null: it will not), so a client may start freezing its environment as soon as '
            "the call returns. The record's answer is the one that counts: a snapshot it does not want is dropped."
        ),
    )
    audit = serializers.BooleanField(
        required=False,
        help_text=(
            "Hits only, present when true: the hit was sampled for the determinism audit. A client whose environment "
            "is at the hit's parent state re-executes the call there and reports the result "
            "(POST .../nodes/{node_id}/audit)."
        ),
    )


class RecordSerializer(CallContextSerializer):
    result = serializers.JSONField(
        help_text=(
            "What the tool answered. Stored and served as sent: a hit answers the same JSON, its objects' keys in the "
            "order they were recorded in."
        )
    )
    exec_ms = serializers.FloatField(min_value=0, max_value=MAX_MS)
    mutated = serializers.BooleanField(
        required=False,
        allow_null=True,
        help_text=(
            "Whether the call changed the sandbox, if the client observed it. false records the call as read-only "
            "whatever its tool declares; omit it when unsure."
        ),
    )
    file_times = serializers.DictField(
        child=serializers.IntegerField(min_value=0, max_value=INT64[1]),
        required=False,
        allow_null=True,
        help_text=(
            f"The modification times (ns since the epoch) of what the call changed in the client's sandbox, by path "
            f"(at most {MAX_FILE_TIMES} entries; paths of 1 to {MAX_PATH_LENGTH} characters without NUL, "
            f"{MAX_FILE_TIMES_PATHS} in all). A replay of the call writes them back after it (POST .../file-times), so "
            "that tools reading file times (make, bytecode caches) see the live run's. {}: the call changed no entry's "
            "time. Omit it when unknown: a replay then restores no time from this call on."
        ),
    )
    replay = serializers.BooleanField(
        required=False,
        default=False,
        help_text=(
            "true: the call ran again only to rebuild a sandbox's state after hits. Its time comes off the task's "
            "saved_ms, which counts only time really not spent."
        ),
    )


class FileTimesQuerySerializer(serializers.Serializer):
    history = ToolCallSerializer(many=True)
    call = ToolCallSerializer(help_text="The call the replay leads up to (the miss's).")
    replay = ToolCallSerializer(
        many=True,
        help_text=(
            "The calls the client replays: the last state-changing calls of the history, in order (the miss's replay, "
            "or its tail after a fork)."
        ),
    )


class FileTimesSerializer(serializers.Serializer):
    file_times = serializers.ListField(
        child=serializers.DictField(child=serializers.IntegerField(), allow_null=True),
        help_text=(
            "One entry per replayed call, in order: the modification times (ns, by path) its call left when it was "
            "recorded; the client writes them back after replaying it. null where they were not kept, or where "
            "'replay' is not the history's last state-changing calls: from the first null on, the client restores "
            "no times (later calls' past times after a replayed call's own would reverse their order)."
        ),
    )


class RecordResponseSerializer(serializers.Serializer):
    node_id = serializers.IntegerField()
    created = serializers.BooleanField()
    mutates = serializers.BooleanField(help_text="The node's: false if the call is recorded as read-only.")
    snapshot = serializers.ChoiceField(choices=["wanted", "skipped"])
    evicted = serializers.ListField(child=serializers.CharField())


class SnapshotRegisterSerializer(serializers.Serializer):
    ref = serializers.CharField(max_length=300)
    backend = serializers.CharField(max_length=40)
    size_bytes = serializers.IntegerField(min_value=0, max_value=MAX_SNAPSHOT_BYTES, required=False)
    create_ms = serializers.FloatField(min_value=0, max_value=MAX_MS, required=False)


class NodeAuditSerializer(serializers.Serializer):
    result = serializers.JSONField(help_text="The call's result, re-executed at the node's parent state.")
    rollout_id = serializers.CharField(max_length=MAX_ID_LENGTH, required=False, allow_blank=True)


class NodeAuditedSerializer(serializers.Serializer):
    divergent = serializers.BooleanField(help_text="The result differs from the node's: the node is no longer served.")


class SnapshotRegisteredSerializer(serializers.Serializer):
    snapshot_id = serializers.IntegerField()
    ref = serializers.CharField()
    evicted = serializers.ListField(child=serializers.CharField())


class ErrorBodySerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()
    details = serializers.JSONField(allow_null=True)


class ErrorSerializer(serializers.Serializer):
    error = ErrorBodySerializer()


class NodeEvictSerializer(serializers.Serializer):
    subtree = serializers.BooleanField(
        default=False,
        help_text=(
            "false: evict only the node's live snapshot (its result stays cached); true: evict the live snapshots of "
            "the node and its descendants and delete those nodes with their results."
        ),
    )


class NodePinSerializer(serializers.Serializer):
    pinned = serializers.BooleanField(help_text="A pinned node's snapshot is never evicted by the budget.")


class AuditedSerializer(serializers.Serializer):
    action = serializers.CharField()
    outcome = serializers.CharField()
    target = serializers.CharField()
    details = serializers.JSONField(help_text="What was done, as the audit log has it.")


def audited_json(entry) -> dict:
    """A maintainer action's answer: its audit log entry."""
    return {"action": entry.action, "outcome": entry.outcome, "target": entry.target, "details": entry.details}
