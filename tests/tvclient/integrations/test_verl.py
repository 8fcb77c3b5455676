"""veRL 0.9.1 as released, in its own venv (lab/frameworks/specs/verl.txt), against the served
tvcache: ToolAgentLoop runs scripted trajectories over tools that veRL's `load_all_tools` builds
from a tool config YAML (lab/frameworks/verl_rollouts.py), uncached, then through tvcache twice;
and every example of docs/integrations/verl.md runs there as written."""

import json
import re
from pathlib import Path

import pytest

from lab.frameworks.venvs import DRIVERS, ROOT, Framework

pytestmark = pytest.mark.slow  # a venv of the framework's own, driven in a subprocess

DOC = ROOT / "docs" / "integrations" / "verl.md"
STATE_CHANGING = ("search", "note", "answer")
SAMPLES, ROLLOUTS = 3, 2


def served(tvcache) -> dict[str, str]:
    return {"TVCACHE_URL": tvcache.url, "TVCACHE_TOKEN": tvcache.token}


@pytest.mark.django_db(transaction=True)
def test_tool_agent_loop_through_tvcache_is_the_uncached_loop(tvcache):
    done = Framework.named("verl").run(
        [
            str(DRIVERS / "verl_rollouts.py"),
            "--passes",
            "uncached,first,repeat",
            "--samples",
            str(SAMPLES),
            "--rollouts",
            str(ROLLOUTS),
        ],
        env=served(tvcache),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    document = json.loads(done.stdout.splitlines()[-1])
    passes = document["passes"]
    uncached = passes["uncached"]["trajectories"]

    # What the uncached loop observed is what the cases are about.
    first = uncached[0]
    assert "'queries': ['alpha', 'alphas']" in first["extra_fields"]  # session data in extra_fields
    assert first["calc_reward"] == [["2.0", "float"]]  # the answer instance's state, scored
    assert [["0.0", "float"]] == uncached[1]["calc_reward"]  # the wrong answer of the odd rollout
    calls: dict[str, list[str]] = {}
    for name, *call in first["calls"]:
        calls.setdefault(name, call)  # each tool's first call
    assert calls["lookup"][0].startswith('ToolResponse(text=\'{"word": "alpha"')  # a FunctionTool
    assert calls["lookup"][1:3] == ["0.5", "float"]
    assert calls["search"][3] == "{'zeta': 1, 'alpha': 'alpha'}"  # a dict with unsorted keys
    assert "np.float64" in calls["stats"][3]  # not JSON: runs uncached

    # A loop that keeps one instance per trajectory, without agent_data: calc_reward after each call.
    kept = passes["uncached"]["kept_instances"]
    assert [[score for *_, score, _ in instance] for instance in kept] == [["0.0", "1.0"]] * 2

    # Every observation, reward, metric, calc_reward, extra_fields and token the same.
    for name in ("first", "repeat"):
        for expected, got in zip(uncached, passes[name]["trajectories"], strict=True):
            assert got == expected, (name, expected["sample"], expected["rollout"])
        assert passes[name]["kept_instances"] == kept, name
    assert document["trajectories_open"] == 0  # each rollout ended with its AgentData or instance

    repeat = passes["repeat"]
    stats_calls = SAMPLES * ROLLOUTS
    assert {name: repeat["executed"].get(name, 0) for name in (*STATE_CHANGING, "lookup")} == {
        "search": 0,
        "note": 0,
        "answer": 0,
        "lookup": 0,
    }
    assert repeat["executed"]["stats"] == stats_calls  # uncacheable: it runs every time
    assert repeat["service"]["misses"] == stats_calls
    assert repeat["service"]["hits"] > 0
    assert passes["first"]["executed"]["search"] >= passes["uncached"]["executed"]["search"] // ROLLOUTS

    # What a cached call could not give back is refused, not answered otherwise.
    refused = document["refused"]
    assert (
        "function tool's file: name it with wrapped_function" in refused["function_as_class"]
    )  # when veRL builds the tools
    assert (
        "declared tvcache_read_only but changed agent_data.extra_fields" in refused["read_only_writes_extra_fields"]
    )  # out of ToolAgentLoop.run, not an observation


def doc_blocks() -> list[tuple[str, str, str]]:
    """The doc's fenced examples: (language, title, text)."""
    pattern = re.compile(r'^```(\w+)(?: title="([^"]+)")?\n(.*?)^```', re.M | re.S)
    return [(language, title or "", text) for language, title, text in pattern.findall(DOC.read_text())]


def test_the_docs_name_only_what_verl_0_9_1_has():
    text = DOC.read_text()
    assert "gsm8k_tool" not in text and "verl.tools.utils" not in text
    modules = set(re.findall(r"(?<![\w./])(verl(?:\.\w+)+)", text))
    done = Framework.named("verl").run(
        [
            "-c",
            (
                "import importlib, sys\n"
                "for name in sys.argv[1:]:\n"
                "    module, _, attribute = name.rpartition('.')\n"
                "    try:\n"
                "        importlib.import_module(name)\n"
                "    except ImportError:\n"
                "        getattr(importlib.import_module(module), attribute)\n"
            ),
            *sorted(modules),
        ]
    )
    assert modules and done.returncode == 0, done.stderr[-3000:]


@pytest.mark.django_db(transaction=True)
def test_every_example_of_the_docs_runs(tvcache, tmp_path: Path):
    blocks = doc_blocks()
    assert {language for language, _, _ in blocks} >= {"yaml", "python"}
    assert all(title for language, title, _ in blocks if language in ("yaml", "python"))  # none left out
    for _, title, text in blocks:
        if title:
            (tmp_path / title).write_text(text)
    scripts = [title for language, title, _ in blocks if language == "python" and title.startswith("run")]
    assert scripts
    for script in scripts:
        done = Framework.named("verl").run([str(tmp_path / script)], env=served(tvcache), cwd=tmp_path, timeout=300)
        assert done.returncode == 0, (script, done.stderr[-4000:])
