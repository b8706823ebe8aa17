"""Sparse attention kernels: block selection, block-sparse attention and its context-parallel ring.

Importing this package imports neither torch nor triton: transformers imports any importable top-level
``kernels`` package when ``python main.py`` runs from the repository root, so the public names are
resolved lazily on first access (PEP 562).
"""

from importlib import import_module

_EXPORTS = {
    "block_sparse_attention": ".attention",
    "BACKENDS": ".attention",
    "select_blocks": ".selection",
    "rank_blocks": ".selection",
    "BlockRanking": ".selection",
    "SelectionStats": ".selection",
    "LayerBudget": ".selection",
    "select_with_budget": ".selection",
    "BudgetedSelection": ".selection",
    "reference_block_sparse_attention": ".reference",
    "attention_recall": ".recall",
    "context_shard": ".ring",
    "context_unshard": ".ring",
    "sparse_ring_attention": ".ring",
    "rank_blocks_striped": ".selection",
    "select_blocks_striped": ".selection",
    "select_with_budget_striped": ".selection",
    "StripedRanking": ".selection",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
