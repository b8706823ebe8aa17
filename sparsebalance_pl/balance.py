"""The two balance measures every part reports (imbalance of a step, balance efficiency of a run), defined
once here: the planner, the sampler, the DST callback and the benchmarks all call these."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["balance_efficiency", "imbalance"]

ArrayLike = Iterable[float] | np.ndarray


def _rounds(times: ArrayLike) -> np.ndarray:
    """[rounds, ranks]: a step's times per rank, or per micro-batch round and rank (ranks wait for each other at
    every micro-batch under FSDP, so each round is its own synchronisation)."""
    t = np.asarray(list(times) if not isinstance(times, np.ndarray) else times, dtype=np.float64)
    return np.atleast_2d(t)


def imbalance(times: ArrayLike) -> float:
    """Time of the step over its perfectly balanced time: max over mean of the ranks' times (summed over the
    micro-batch rounds for [rounds, ranks]). 1.0 is perfect balance."""
    t = _rounds(times)
    mean = float(t.mean(axis=1).sum()) if t.size else 0.0
    return float(t.max(axis=1).sum()) / mean if mean > 0 else 1.0


def balance_efficiency(steps: Iterable[ArrayLike]) -> float:
    """Sum over steps of the mean rank time over the sum of the slowest (1.0 is perfect); each step as in
    ``imbalance``."""
    mean = slowest = 0.0
    for times in steps:
        t = _rounds(times)
        if t.size:
            mean += float(t.mean(axis=1).sum())
            slowest += float(t.max(axis=1).sum())
    return mean / slowest if slowest > 0 else 1.0
