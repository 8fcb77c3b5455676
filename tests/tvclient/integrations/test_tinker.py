"""Tinker: tinker-cookbook 0.6.1 as released, driven through its own `do_group_rollout` in its
venv (lab/frameworks/specs/tinker.txt) against a served tvcache.

The driver (lab/frameworks/tinker_rollouts.py) runs a group of the cookbook's tool-use envs
(`build_agent_tool_env`, its Qwen3 renderer, its `@tool` tools, a sandbox factory as in its
Harbor recipe) with a scripted model, once uncached and twice through TVCacheEnvGroupBuilder on
one task, and prints what each pass produced and what ran for real.
"""

import json
import re
from pathlib import Path

import pytest

from cache.models import Task
from lab.frameworks.venvs import DRIVERS, ROOT, Framework

pytestmark = pytest.mark.slow  # a venv of the framework's own, driven in a subprocess

CALLS_PER_GROUP = 20  # sandbox, stamp, note and lookup calls of the three samples' scripts
LOOKUPS_PER_GROUP = 4  # `lookup` answers a tuple: no exact JSON, run live every time


def run_in_venv(tvcache, args, timeout=300):
    done = Framework.named("tinker").run(
        args, env={"TVCACHE_URL": tvcache.url, "TVCACHE_TOKEN": tvcache.token}, timeout=timeout, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.fixture
def passes(tvcache, task_id):
    done = run_in_venv(tvcache, [str(DRIVERS / "tinker_rollouts.py"), "--task-id", task_id, "--passes", "2"])
    document = json.loads(done.stdout)
    uncached, first, repeat = document["passes"]
    assert [uncached["mode"], first["mode"], repeat["mode"]] == ["uncached", "cached", "cached"]
    return uncached, first, repeat, document["service_stats"]


PRODUCED = ("group_repr", "trajectories", "total_rewards", "seen")
EXPECTED_REPEAT = {
    "hits": CALLS_PER_GROUP - LOOKUPS_PER_GROUP,
    "misses": LOOKUPS_PER_GROUP,
    "executed": LOOKUPS_PER_GROUP,
    "uncacheable": LOOKUPS_PER_GROUP,
    "replayed": 0,
    "record_failures": 0,
    "detached": 0,
    "offline": 0,
    "rollouts": 9,
}


@pytest.mark.django_db(transaction=True)
def test_do_group_rollout_through_tvcache_is_the_uncached_rollout_and_the_repeat_runs_nothing(passes, task_id):
    uncached, first, repeat, stats = passes

    # What the rollouts produced, byte for byte: the TrajectoryGroup (observations, actions,
    # rewards, metrics, logs), every StepResult, ToolResult and SandboxResult, the message
    # histories with their tool messages.
    for name in PRODUCED:
        assert first[name] == uncached[name], name
        assert repeat[name] == uncached[name], name
    assert uncached["total_rewards"] == [1.0, 1.0, 2.0]
    tool_results = "\n".join(result for sample in repeat["seen"].values() for result in sample["tools"])
    # A result with no exact JSON form comes back as the tool made it (a tuple)...
    assert "metadata={'span': (0, 16)}" in tool_results
    # ...and dicts with their keys in the tool's order, not sorted.
    assert "metadata={'zeta': 1, 'alpha': 'wrote a', 'mid': {'y': 1, 'b': [2]}}" in tool_results
    assert "metrics={'stdout_bytes': 2, 'backend': 'folder'}" in "\n".join(repeat["seen"]["0"]["sandbox"])
    # Each tool message answers its own call's id, hit or not; a call without an id, none.
    assert (
        "'call-1-1' ToolResult(messages=[{'role': 'tool', 'content': '1 notes', 'tool_call_id': 'call-1-1'"
        in tool_results
    )
    assert "'' ToolResult(messages=[{'role': 'tool', 'content': 'the first letter', 'tool_call_id': ''" in tool_results

    assert uncached["ran"] == {"sandboxes_started": 3, "run_command": 10, "read_file": 3, "note": 3, "lookup": 4}
    # The first group's samples start alike: single flight runs the first command once. (Which
    # sample runs a later shared call, and so how many sandboxes start, is timing.)
    assert first["executor"]["hits"] >= 2 and first["ran"]["sandboxes_started"] <= 3
    # The repeat group: every call but the uncacheable lookups is a hit; no sandbox starts and
    # nothing that changes state runs.
    assert repeat["ran"] == {"lookup": LOOKUPS_PER_GROUP}
    counters = {name: repeat["executor"][name] for name in EXPECTED_REPEAT}
    assert counters == EXPECTED_REPEAT  # (`waited`, for a lookup another sample runs, is timing)
    assert stats["hits"] == first["executor"]["hits"] + repeat["executor"]["hits"]
    # Every rollout declares the task alike: it was put once (a changed spec drops the graph).
    assert Task.objects.get(name=task_id).version == 1


def python_examples(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", page.read_text(), flags=re.MULTILINE | re.DOTALL)


@pytest.mark.django_db(transaction=True)
def test_the_docs_examples_run_in_the_tinker_venv(tvcache, tmp_path):
    examples = python_examples(ROOT / "docs" / "integrations" / "tinker.md")
    assert len(examples) >= 2
    for number, example in enumerate(examples):
        script = tmp_path / f"example_{number}.py"
        script.write_text(example)
        run_in_venv(tvcache, [str(script)])
