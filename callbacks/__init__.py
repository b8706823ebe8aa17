"""Lightning callbacks of SparseBalance: dynamic sparsity tuning and batch-plan monitoring."""

from sparsebalance_pl.callbacks.dst import DynamicSparsityTuning
from sparsebalance_pl.callbacks.plan_monitor import BatchPlanMonitor
from sparsebalance_pl.callbacks.protocol import TIMED_TERMS, SparsityReport, SparsityTunable

__all__ = ["TIMED_TERMS", "BatchPlanMonitor", "DynamicSparsityTuning", "SparsityReport", "SparsityTunable"]
