"""The driver's `@function_tool` functions, a file veRL loads as `function_tool_path`."""

import time

from verl.tools.function_tool import function_tool
from verl_tools import EXECUTED, TOOL_SECONDS


@function_tool
def lookup(word: str) -> tuple:
    """Look a word up in the dictionary.

    Args:
        word: The word to look up.
    """
    started = time.perf_counter()
    entry = {"word": word, "length": len(word), "vowels": sum(c in "aeiou" for c in word)}
    EXECUTED["lookup"] += 1
    TOOL_SECONDS["lookup"] += time.perf_counter() - started
    return entry, 0.5
