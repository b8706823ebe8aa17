"""Data: litdata corpora, packing and sparsity-aware batching (SAB)."""

from sparsebalance_pl.datamodules.datamodule import CorpusConfig, EvaluationConfig, LongContextDataModule, PlanItems
from sparsebalance_pl.datamodules.partition import CapacityError, karmarkar_karp, partition
from sparsebalance_pl.datamodules.planner import GlobalBatch, PlannerConfig, Segment, plan_epoch
from sparsebalance_pl.datamodules.packing import collate_packed, stripe_packed
from sparsebalance_pl.datamodules.sampler import BatchingConfig, PaddingItem, SharedStream, SparsityAwareSampler

__all__ = [
    "BatchingConfig",
    "CapacityError",
    "CorpusConfig",
    "EvaluationConfig",
    "GlobalBatch",
    "LongContextDataModule",
    "PaddingItem",
    "PlanItems",
    "PlannerConfig",
    "Segment",
    "SharedStream",
    "SparsityAwareSampler",
    "collate_packed",
    "karmarkar_karp",
    "partition",
    "plan_epoch",
    "stripe_packed",
]
