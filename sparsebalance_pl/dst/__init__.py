"""Dynamic sparsity tuning (DST) as plain algorithms: the budget rule (``budget``) and the controller that applies
it to every rank of a step (``controller``). The Lightning callback
(``sparsebalance_pl.callbacks.DynamicSparsityTuning``) and the emulation of many ranks both call them."""

from sparsebalance_pl.dst.budget import (
    ANCHORS,
    FIXED_ANCHORS,
    Anchor,
    Outlook,
    RankBudget,
    adaptive_anchor,
    anchor_time,
    outlook,
    raises_to_dense,
    rank_budget,
    reachable_anchor,
    recall_drop,
    target_time,
)
from sparsebalance_pl.dst.controller import TRUSTED_ERROR, Decision, DSTController, check_settings, confidence

__all__ = [
    "ANCHORS",
    "Anchor",
    "DSTController",
    "Decision",
    "FIXED_ANCHORS",
    "Outlook",
    "RankBudget",
    "TRUSTED_ERROR",
    "adaptive_anchor",
    "anchor_time",
    "check_settings",
    "confidence",
    "outlook",
    "raises_to_dense",
    "rank_budget",
    "reachable_anchor",
    "recall_drop",
    "target_time",
]
