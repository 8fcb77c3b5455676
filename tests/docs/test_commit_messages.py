"""The commit-message check CI runs (.ci/commits.py) refuses what docs/contributing.md rules out."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "commits.py"


@pytest.fixture(scope="module")
def commits():
    spec = importlib.util.spec_from_file_location("commits", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "subject, body, wanted",
    [
        ("cache: type the state a node keeps", "Why it changed.", []),
        ("cache, sandboxes: give the limits one home", "Why.", []),
        ("cache: fix the lookup " + "x" * 60, "Why.", ["characters"]),
        ("Fix the lookup", "Why.", ["area: imperative summary"]),
        ("cache: Fix the lookup", "Why.", ["area: imperative summary"]),
        ("cache: fix the lookup.", "Why.", ["full stop"]),
        ("cache: fix the lookup", "  \n", ["body"]),
    ],
)
def test_each_rule_is_checked(commits, subject, body, wanted):
    found = commits.problems(subject, body)
    assert len(found) == len(wanted) and all(w in p for w, p in zip(wanted, found))


def test_the_history_since_the_rule_keeps_it(commits):
    assert commits.main([]) == 0
