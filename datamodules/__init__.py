"""Data: litdata corpora, packing and sparsity-aware batching (SAB)."""

from sparsebalance_pl.datamodules.datamodule import (
    BatchingConfig,
    CorpusConfig,
    EvaluationConfig,
    LongContextDataModule,
)
from sparsebalance_pl.cost.density import DensityEstimator
from sparsebalance_pl.datamodules.partition import CapacityError, karmarkar_karp, partition
from sparsebalance_pl.datamodules.planner import (
    GlobalBatch,
    PlannerConfig,
    Segment,
    plan_epoch,
)

__all__ = [
    "BatchingConfig",
    "CorpusConfig",
    "EvaluationConfig",
    "CapacityError",
    "GlobalBatch",
    "LongContextDataModule",
    "PlannerConfig",
    "Segment",
    "karmarkar_karp",
    "partition",
    "plan_epoch",
]
