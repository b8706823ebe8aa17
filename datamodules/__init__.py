"""Data: litdata corpora, packing and sparsity-aware batching (SAB)."""

from sparsebalance_pl.datamodules.datamodule import LongContextDataModule
from sparsebalance_pl.datamodules.density import DensityEstimator
from sparsebalance_pl.datamodules.partition import CapacityError, karmarkar_karp, partition
from sparsebalance_pl.datamodules.planner import (
    GlobalBatch,
    PlannerConfig,
    PlanState,
    Segment,
    balance_efficiency,
    plan_epoch,
)

__all__ = [
    "CapacityError",
    "DensityEstimator",
    "GlobalBatch",
    "LongContextDataModule",
    "PlanState",
    "PlannerConfig",
    "Segment",
    "balance_efficiency",
    "karmarkar_karp",
    "partition",
    "plan_epoch",
]
