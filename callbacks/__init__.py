"""Lightning callbacks of SparseBalance: dynamic sparsity tuning, density calibration and batch-plan monitoring.

Names this package used to re-export resolve at their own homes, with a warning naming them, until the next
minor version.
"""

from sparsebalance_pl.callbacks.density_calibration import DensityCalibration
from sparsebalance_pl.callbacks.dst import DynamicSparsityTuning
from sparsebalance_pl.callbacks.plan_monitor import BatchPlanMonitor
from sparsebalance_pl.lazy_exports import lazy_exports

__all__ = ["BatchPlanMonitor", "DensityCalibration", "DynamicSparsityTuning"]
_MOVED = {
    "SparsityTunable": "sparsebalance_pl.attention",
    "AttentionTimer": "sparsebalance_pl.timing",
    "BudgetedSelection": "sparsebalance_pl.kernels",
    "LayerBudget": "sparsebalance_pl.kernels",
    "select_with_budget": "sparsebalance_pl.kernels",
    "TIMED_TERMS": "sparsebalance_pl.cost",
    "CostModel": "sparsebalance_pl.cost",
    "SparsityReport": "sparsebalance_pl.cost",
    "observe_step": "sparsebalance_pl.cost",
}
__getattr__, __dir__ = lazy_exports(__name__, {}, moved=_MOVED)
