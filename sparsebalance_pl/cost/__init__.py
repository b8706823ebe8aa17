"""The cost model: latency model, density estimator, rank speeds and recall prices as one object with one owner,
and the profiler that measures its latency table (``sparsebalance_pl.cost.profiler``). The latency model's own
names are public at ``sparsebalance_pl.latency``."""

from sparsebalance_pl.cost.density import DensityEstimator
from sparsebalance_pl.cost.model import (
    TIMED_TERMS,
    CostModel,
    SparsityReport,
    StepObservation,
    StepRecord,
    observe_step,
)
from sparsebalance_pl.cost.recall import RecallPrices
from sparsebalance_pl.lazy_exports import lazy_exports

__all__ = [
    "TIMED_TERMS",
    "CostModel",
    "DensityEstimator",
    "RecallPrices",
    "SparsityReport",
    "StepObservation",
    "StepRecord",
    "observe_step",
]
__getattr__, __dir__ = lazy_exports(
    __name__, {}, moved=dict.fromkeys(("LatencyModel", "LatencyTable", "LatencyTableError"), "sparsebalance_pl.latency")
)
