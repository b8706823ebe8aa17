"""The cost model: latency model, density estimator, rank speeds and recall prices as one object with one owner,
and the profiler that measures its latency table (``sparsebalance_pl.cost.profiler``)."""

from sparsebalance_pl.cost.density import DensityEstimator
from sparsebalance_pl.cost.latency import LatencyModel, LatencyTable, LatencyTableError
from sparsebalance_pl.cost.model import (
    TIMED_TERMS,
    CostModel,
    SparsityReport,
    StepObservation,
    StepRecord,
    observe_step,
)
from sparsebalance_pl.cost.recall import RecallPrices

__all__ = [
    "TIMED_TERMS",
    "CostModel",
    "DensityEstimator",
    "LatencyModel",
    "LatencyTable",
    "LatencyTableError",
    "RecallPrices",
    "SparsityReport",
    "StepObservation",
    "StepRecord",
    "observe_step",
]
