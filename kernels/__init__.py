"""Sparse attention kernels: block selection, block-sparse attention and its context-parallel ring.

Importing this package imports neither torch nor triton: transformers imports any importable top-level
``kernels`` package when ``python main.py`` runs from the repository root, so the public names are
resolved lazily on first access (PEP 562).
"""

from sparsebalance_pl.lazy_exports import lazy_exports

_EXPORTS = {
    "block_sparse_attention": ".attention",
    "BACKENDS": ".attention",
    "PackedDocuments": ".layout",
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
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
