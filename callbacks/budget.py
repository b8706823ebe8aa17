"""Moved: the DST rule lives in ``sparsebalance_pl.dst`` beside the other algorithms. Its names still resolve here,
with a warning naming their new home, until the next minor version."""

from sparsebalance_pl.lazy_exports import lazy_exports

_MOVED = ("ANCHORS", "FIXED_ANCHORS", "Anchor", "Outlook", "RankBudget", "adaptive_anchor", "anchor_time", "outlook",
          "raises_to_dense", "rank_budget", "reachable_anchor", "recall_drop", "target_time")
__getattr__, __dir__ = lazy_exports(__name__, {}, moved=dict.fromkeys(_MOVED, "sparsebalance_pl.dst"))
