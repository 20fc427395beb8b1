"""Spread of repeated measurements: mean, median, p90, p99, stddev, and a bootstrap interval.

Percentiles interpolate linearly between order statistics (numpy's default), stddev is the sample
standard deviation (n - 1). The speedup interval resamples *samples* (prompts) with replacement,
keeping each sample's generations together, so "1.05x [0.9, 1.2]" shows how much of a difference
between two runs the choice of prompts alone explains.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between order statistics; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def spread(values: Sequence[float]) -> dict[str, float | int | None]:
    """mean, median, p90, p99, std (sample; 0 for one value) and n; None fields for no values."""
    if not values:
        return {"n": 0, "mean": None, "median": None, "p90": None, "p99": None, "std": None}
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
    }


def bootstrap(
    groups: Sequence[T], statistic: Callable[[list[T]], float], *, resamples: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """Percentile bootstrap of `statistic` over `groups` resampled with replacement: 95% interval and std."""
    if not groups:
        return {"ci95": None, "std": None, "resamples": 0}
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        pick = [groups[rng.randrange(len(groups))] for _ in groups]
        values.append(statistic(pick))
    return {
        "ci95": [percentile(values, 2.5), percentile(values, 97.5)],
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "resamples": resamples,
    }
