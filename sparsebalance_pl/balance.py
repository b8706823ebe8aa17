"""The two balance measures every part reports (DESIGN.md 6), defined once."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def imbalance(times: Sequence[float]) -> float:
    """Max over mean of the ranks' times in one step (1.0 is perfect balance)."""
    t = np.asarray(times, dtype=np.float64)
    return float(t.max() / t.mean()) if t.size and t.mean() > 0 else 1.0


def balance_efficiency(steps: Iterable[Sequence[float]]) -> float:
    """Sum over steps of the mean rank time over the sum of the slowest (1.0 is perfect)."""
    mean = slowest = 0.0
    for times in steps:
        t = np.asarray(times, dtype=np.float64)
        mean += float(t.mean())
        slowest += float(t.max())
    return mean / slowest if slowest > 0 else 1.0
