"""TEMPORARY: per-request timestamps of tool-server calls (TVCACHE_MISS_PROFILE=dir)."""

from __future__ import annotations

import json
import os
import threading
import time

DIR = os.environ.get("TVCACHE_MISS_PROFILE", "")
_local = threading.local()


def attach(marks: list | None) -> None:
    _local.marks = marks


def mark(label: str) -> None:
    marks = getattr(_local, "marks", None)
    if marks is not None:
        marks.append((label, time.perf_counter()))


def write(marks: list) -> None:
    if not DIR or not marks:
        return
    with open(os.path.join(DIR, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(marks) + "\n")
