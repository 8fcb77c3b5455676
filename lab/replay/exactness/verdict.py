"""The one definition of a wrong answer: a cached answer, hit or miss, against a fresh execution
of the same history."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Verdict:
    kind: str  # "hits" or "misses": what the cache answered with
    wrong: bool = False  # it differs from every fresh execution of the history tried
    reproduced_after: int | None = None  # it differs from the fresh execution, but this many more gave it

    @property
    def answer(self) -> str:
        return "hit" if self.kind == "hits" else "miss"


def judge(answer: Any, fresh: Any, *, cached: bool, reproduce: Callable[[], int | None] | None = None) -> Verdict:
    """A cached answer against a fresh execution of the same history; where they differ,
    `reproduce` tells after how many more fresh executions one answered as the cache did (None:
    none did, or none is tried)."""
    kind = "hits" if cached else "misses"
    if answer == fresh:
        return Verdict(kind)
    tries = reproduce() if reproduce is not None else None
    return Verdict(kind, wrong=tries is None, reproduced_after=tries)
