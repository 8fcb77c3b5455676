"""Exec times as a histogram: a task keeps, per tool, how many of its nodes fall in each bucket of
exec time (cache.models.TaskTotal), so its median comes from a few hundred integers whatever the
number of nodes, within a bucket's width (about 12%) of the exact one.

Bucket b holds the times t (ms) with floor(log2(1 + t) * PER_OCTAVE) = b; the last one holds
every longer time. The service computes buckets in SQL (`BUCKET_SQL`), always from the stored
value, so a node counted in at record time is counted out of the same bucket when it goes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

PER_OCTAVE = 6
BUCKETS = 120  # up to 2**20 ms (~17 minutes); longer times share the last bucket

# The bucket of an exec time `{ms}` (float8 ms), clamped before the cast: a time past the last
# bucket (or NaN, which PostgreSQL sorts above every number) lands in the last one.
BUCKET_SQL = f"least({BUCKETS - 1}, floor(ln(1 + greatest({{ms}}, 0)) * {PER_OCTAVE} / ln(2)))::int"


def bucket_low(bucket: int) -> float:
    """The shortest time (ms) of a bucket."""
    return 2 ** (bucket / PER_OCTAVE) - 1


def bucket(ms: float) -> int:
    """The bucket of a time, as BUCKET_SQL computes it (for tests and seeding)."""
    return min(BUCKETS - 1, math.floor(math.log(1 + max(ms, 0.0)) * PER_OCTAVE / math.log(2)))


def histogram_median(counts: Sequence[int]) -> float | None:
    """The median time of a histogram as percentile_cont(0.5) takes it (the mean of the two middle
    times when the count is even), each time placed evenly inside its bucket: within a bucket's
    width of the exact median. None when it counts nothing."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = (total - 1) / 2
    return (_order_statistic(counts, math.floor(rank)) + _order_statistic(counts, math.ceil(rank))) / 2


def _order_statistic(counts: Sequence[int], k: int) -> float:
    """The k-th shortest time (from 0): the (k - before + 0.5)-th of its bucket's `count` evenly spaced."""
    before = 0
    for index, count in enumerate(counts):
        if k < before + count:
            low, high = bucket_low(index), bucket_low(index + 1)
            return low + (high - low) * (k - before + 0.5) / count
        before += count
    raise ValueError(f"no time of rank {k} in {sum(counts)}")
