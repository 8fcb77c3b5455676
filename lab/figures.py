"""The one percentile of the lab's reports (replays, benchmarks)."""

from __future__ import annotations


def percentile(values: list[float], q: float, ndigits: int | None = None) -> float | None:
    """Nearest-rank percentile (q in 0..100), rounded to `ndigits` if given; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    value = ordered[max(1, min(len(ordered), int(-(-q * len(ordered) // 100)))) - 1]
    return value if ndigits is None else round(value, ndigits)


def median_p95(figure: dict | None) -> str:
    """A figure's `median_ms / p95_ms` for a report's table, "-" where there is none."""
    if not figure or figure.get("median_ms") is None:
        return "-"
    return f"{figure['median_ms']:g} / {figure['p95_ms']:g}"
