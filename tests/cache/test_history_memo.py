"""The digests that key the process's memos of parsed histories and their state chains
(cache.inputs.history_digests): equal only for the same values, and the digest of the history
after a call is the one the rollout's next call sends."""

from __future__ import annotations

import orjson
import pytest

from cache import inputs
from cache.inputs import history_digests, parse_call_context

A = {"tool": "write", "args": {"path": "f", "content": 1}}
B = {"tool": "bash", "args": {"command": "make", "timeout_s": 30}}


@pytest.mark.parametrize("history", [[], [A], [A, B, A]])
def test_the_digest_after_a_call_is_the_next_calls_history_digest(history):
    _, after = history_digests(history, B)
    assert after == history_digests(orjson.loads(orjson.dumps([*history, B])), A)[0]


def test_values_equal_in_python_but_of_another_type_are_other_histories():
    digests = {history_digests([{"tool": "write", "args": {"n": value}}], B)[0] for value in (1, 1.0, True)}
    assert len(digests) == 3


def test_a_memoized_history_parses_to_the_same_calls():
    first = parse_call_context({"history": [A, B], "call": A})
    again = parse_call_context({"history": [A, B, A], "call": B})  # the history the first call memoized
    assert again.history == (*first.history, first.call) and again.history_digest == first.next_digest


def test_a_body_that_does_not_serialize_is_parsed_without_the_memo():
    assert history_digests("not a list", A) == (b"", b"")


def test_the_same_call_after_the_same_history_parses_no_call_again(monkeypatch):
    """Another rollout's lookup (or a lookup's record) of a call parsed lately: nothing of it is
    parsed again, and it gives the same context but for the rollout's own fields."""
    first = parse_call_context({"history": [A, B], "call": {"tool": "read", "args": {"path": "once"}}, "epoch": 1})
    parsed = []
    monkeypatch.setattr(inputs, "parse_call", lambda *args, **kwargs: parsed.append(args))
    again = parse_call_context(
        {"history": [A, B], "call": {"tool": "read", "args": {"path": "once"}}, "rollout_id": "r2", "epoch": 2}
    )
    assert parsed == []
    assert (again.history, again.call, again.next_digest) == (first.history, first.call, first.next_digest)
    assert (again.rollout_id, again.epoch) == ("r2", 2)
