"""TEMPORARY (reverted in the next commit; docs/design/hot-path.md cites this one): where a
tool-server miss's time goes between the timeline marks of core/missprofile.py.

    TVCACHE_MISS_PROFILE=/tmp/timeline manage.py replay_terminal --direct-calls session ...
    python -m lab.bench.miss_timeline /tmp/timeline

Per step between two consecutive marks of the misses (requests that executed their call): the mean
over all misses (a miss without the step counts 0), how many had it, its median and mean."""

from __future__ import annotations

import glob
import json
import statistics
import sys
from collections import defaultdict


def main(folder: str) -> None:
    steps: dict[str, list[float]] = defaultdict(list)
    totals, misses = [], 0
    for path in glob.glob(f"{folder}/*.jsonl"):
        for line in open(path):
            marks = json.loads(line)
            if "miss_execute" not in [m[0] for m in marks]:
                continue
            misses += 1
            totals.append((marks[-1][1] - marks[0][1]) * 1000)
            seen: dict[str, int] = defaultdict(int)
            for (a, ta), (b, tb) in zip(marks, marks[1:]):
                key = f"{a} -> {b}"
                seen[key] += 1
                steps[key + (f" #{seen[key]}" if seen[key] > 1 else "")].append((tb - ta) * 1000)
    print(f"misses {misses}; arrival to sent: median {statistics.median(totals):.2f} ms")
    rows = [(sum(v) / misses, k, len(v), statistics.median(v), statistics.fmean(v)) for k, v in steps.items()]
    for over_all, key, n, median, mean in sorted(rows, key=lambda r: -r[0]):
        print(f"{over_all:8.2f} {n:5d} {median:8.2f} {mean:8.2f}  {key}")


if __name__ == "__main__":
    main(sys.argv[1])
