"""Lightning callbacks of SparseBalance: dynamic sparsity tuning, density calibration and batch-plan monitoring."""

from sparsebalance_pl.callbacks.density_calibration import DensityCalibration
from sparsebalance_pl.callbacks.dst import DynamicSparsityTuning
from sparsebalance_pl.callbacks.plan_monitor import BatchPlanMonitor
from sparsebalance_pl.callbacks.protocol import (
    TIMED_TERMS,
    AttentionTimer,
    BudgetedSelection,
    CostModel,
    LayerBudget,
    SparsityReport,
    SparsityTunable,
    observe_step,
    select_with_budget,
)

__all__ = [
    "TIMED_TERMS",
    "AttentionTimer",
    "BatchPlanMonitor",
    "BudgetedSelection",
    "CostModel",
    "DensityCalibration",
    "DynamicSparsityTuning",
    "LayerBudget",
    "SparsityReport",
    "SparsityTunable",
    "observe_step",
    "select_with_budget",
]
