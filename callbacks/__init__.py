"""Lightning callbacks of SparseBalance: dynamic sparsity tuning, density calibration and batch-plan monitoring."""

from sparsebalance_pl.callbacks.density_calibration import DensityCalibration
from sparsebalance_pl.callbacks.dst import DynamicSparsityTuning
from sparsebalance_pl.callbacks.plan_monitor import BatchPlanMonitor
from sparsebalance_pl.callbacks.protocol import TIMED_TERMS, LayerBudget, SparsityReport, SparsityTunable

__all__ = [
    "TIMED_TERMS",
    "BatchPlanMonitor",
    "DensityCalibration",
    "DynamicSparsityTuning",
    "LayerBudget",
    "SparsityReport",
    "SparsityTunable",
]
