"""Data: litdata corpora, packing and sparsity-aware batching (SAB).

The data module's names load on first use (PEP 562): litdata's build workers are spawned processes that import
``datamodules.builder`` alone, and importing ``datamodule`` eagerly would make each of them import Lightning first
(7-15 s per worker, every time a corpus is built). The other modules need no more than torch, which litdata
imports anyway.
"""

from sparsebalance_pl.datamodules.partition import CapacityError, karmarkar_karp, partition
from sparsebalance_pl.datamodules.planner import GlobalBatch, PlannerConfig, Segment, plan_epoch
from sparsebalance_pl.datamodules.packing import collate_packed, stripe_packed
from sparsebalance_pl.datamodules.sampler import (
    BatchingConfig,
    PaddingItem,
    PlannedBatchSampler,
    SharedStream,
    SparsityAwareSampler,
)
from sparsebalance_pl.lazy_exports import lazy_exports

_LAZY = dict.fromkeys(("CorpusConfig", "EvaluationConfig", "LongContextDataModule", "PlanItems"), ".datamodule")

__all__ = sorted([
    "BatchingConfig", "CapacityError", "GlobalBatch", "PaddingItem", "PlannedBatchSampler", "PlannerConfig", "Segment",
    "SharedStream", "SparsityAwareSampler", "collate_packed", "karmarkar_karp", "partition", "plan_epoch",
    "stripe_packed", *_LAZY,
])
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
