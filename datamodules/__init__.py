"""Data: litdata corpora, packing and sparsity-aware batching (SAB).

The names below load on first use (PEP 562): litdata's build workers are spawned processes that import
``datamodules.builder`` alone, and importing this package eagerly would make each of them import Lightning
first (7-15 s per worker, every time a corpus is built).
"""

from importlib import import_module

_EXPORTS = {
    "datamodule": ("CorpusConfig", "EvaluationConfig", "LongContextDataModule", "PlanItems"),
    "partition": ("CapacityError", "karmarkar_karp", "partition"),
    "planner": ("GlobalBatch", "PlannerConfig", "Segment", "plan_epoch"),
    "packing": ("collate_packed", "stripe_packed"),
    "sampler": ("BatchingConfig", "PaddingItem", "SharedStream", "SparsityAwareSampler"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value
