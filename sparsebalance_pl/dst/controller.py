"""Dynamic sparsity tuning's decisions without Lightning: the budgets of every rank for one step.

It does no harm where its predictions cannot be trusted: a step whose predicted imbalance lies within the cost
model's own measured error keeps the base budgets (the deadband), while that error is large (an uncalibrated
prior, a new module) each rank moves only part of the way toward the anchor (the damping), and a fast rank
stops short of the anchor by that error (the margin), since overshooting it would make it the straggler.

``DSTController.plan`` takes every rank's documents for the coming micro-batch and returns every rank's
budgets. Given the same inputs and the same cost model state it decides the same on every rank. So the
``DynamicSparsityTuning`` callback needs one exchange of document lengths per step and no other, and an
emulation of N ranks in one process calls the very same rule (``sparsebalance_pl.comparison``). The rule itself is
``sparsebalance_pl.dst.budget``; the predictions, and the recall prices of the adaptive anchor, come from the run's
``CostModel``, which learns them from every step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from sparsebalance_pl.balance import imbalance
from sparsebalance_pl.dst.budget import (
    ANCHORS,
    Anchor,
    Outlook,
    RankBudget,
    adaptive_anchor,
    anchor_time,
    outlook,
    raises_to_dense,
    rank_budget,
    reachable_anchor,
    target_time,
)
from sparsebalance_pl.cost import CostModel
from sparsebalance_pl.cost.latency import LatencyModel
from sparsebalance_pl.cost.model import timed_seconds
from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.kernels import LayerBudget


@dataclass(frozen=True)
class Decision:
    """One step's budgets for every rank, and the predictions they came from.

    Attributes:
        anchor: the anchor time in seconds.
        ranks: per rank, its move and per-layer budgets.
        predicted_base: per rank, predicted whole-step seconds at the base budgets.
        predicted: per rank, predicted whole-step seconds at the chosen budgets.
        anchor_drift: the anchor's move since the previous decision, on the previous step's documents (the
            anchor the controller now gives them over the one decided then; None at the first step): what
            learning moved (calibration, and the adaptive anchor's recall prices), apart from the change of
            workload between steps.
    """

    anchor: float
    ranks: list[RankBudget]
    predicted_base: list[float]
    predicted: list[float]
    anchor_drift: float | None = None


#: The cost model error (|log(measured / predicted)|) at which DST moves ranks half way toward the anchor; the
#: fraction falls off steeply above it and is nearly 1 below (0.99 at an error of 0.1, 0.02 uncalibrated).
TRUSTED_ERROR = 0.3


def confidence(error: float) -> float:
    """The fraction of the way to the anchor a rank moves when the cost model's predictions are off by ``error``."""
    return 1.0 / (1.0 + (error / TRUSTED_ERROR) ** 4)


class DSTController:
    """Moves each rank's sparse-attention budget so its predicted step time approaches a common anchor.

    Args:
        cost_model: the run's cost model (predictions per rank, including each rank's learned speed).
        base_budgets: the configured per-layer budgets, which tuning moves away from.
        anchor: ``mean``, ``median``, ``min``, ``max`` of the ranks' predicted times at the base budget, or
            ``adaptive``: the lowest time between min and max whose predicted token-weighted recall loss, from
            what cuts and raises of density cost and bought in recall on documents of each rank's lengths (the
            cost model's ``RecallPrices``), stays within ``recall_tolerance``. Any anchor is raised to the
            longest time a rank takes at its sparsest (``reachable_anchor``).
        p: largest move of tau away from the base budget, in [0, 1]; 0 keeps the base budgets (the static
            baseline). The kept tiles scale with the cost model so that no rank passes the anchor time
            (``sparsebalance_pl.dst.budget``).
        min_density: the lowest density a straggler aims at, in [0, 1].
        recall_tolerance: the adaptive anchor's allowance for predicted loss of mean recall.
        name: how settings are named in error messages.
    """

    def __init__(
        self,
        cost_model: CostModel,
        base_budgets: Sequence[LayerBudget],
        *,
        anchor: Anchor = "mean",
        p: float = 0.1,
        min_density: float = 0.05,
        recall_tolerance: float = 0.02,
        name: str = "DSTController",
    ) -> None:
        check_settings(name, anchor, p, min_density, recall_tolerance)
        self.cost_model = cost_model
        self.base_budgets = [replace(b) for b in base_budgets]
        self.anchor, self.p, self.min_density, self.recall_tolerance = anchor, p, min_density, recall_tolerance
        self.raises_to_dense = raises_to_dense(self.base_budgets, p)
        self.shifts: list[float | None] = []
        self.budgets: list[list[LayerBudget]] = []  # every rank's, as last decided
        self.last: Decision | None = None
        self.last_lengths: list[list[int]] = []
        self.last_shares: list[float] = []

    def plan(self, lengths: Sequence[Sequence[int]], shares: Sequence[float] | None = None) -> Decision:
        """Every rank's budgets for micro-batches of documents ``lengths[rank]``, of which the rank does the part
        ``shares[rank]`` (default 1; ``1 / W`` for a stream shared by a context-parallel group of W ranks,
        whose ranks the module then holds to one budget)."""
        lengths = [[int(n) for n in rank_lengths] for rank_lengths in lengths]
        shares = [1.0] * len(lengths) if shares is None else [float(x) for x in shares]
        if len(self.shifts) != len(lengths):
            self.shifts = [None] * len(lengths)
        models = [self.cost_model.for_rank(r, share) for r, share in enumerate(shares)]
        views = self._views(models, lengths)
        # the cost model's error on the timed part (attention, selection), which is this share of a step at most
        timed = [timed_seconds(model, ls, v.density) / v.base for model, ls, v in zip(models, lengths, views)]
        margin = self.cost_model.error * max(timed)
        anchor = self._anchor(views, lengths, margin)
        drift = None
        if self.last is not None and len(self.last_lengths) == len(lengths) and self.last.anchor > 0:
            last_views = self.outlooks(self.last_lengths, self.last_shares)
            drift = self._anchor(last_views, self.last_lengths, margin) / self.last.anchor
        base = [v.base for v in views]
        targets = self._targets(views, anchor, margin)
        ranks = [
            rank_budget(view, target, self.p, self.base_budgets, shift)
            for view, target, shift in zip(views, targets, self.shifts)
        ]
        self.shifts = [budget.shift for budget in ranks]
        self.budgets = [budget.budgets for budget in ranks]
        moved = [v.at(t) for v, t in zip(views, targets)]
        self.last = Decision(anchor, ranks, base, moved, drift)
        self.last_lengths, self.last_shares = lengths, shares
        return self.last

    def outlooks(self, lengths: Sequence[Sequence[int]], shares: Sequence[float] | None = None) -> list[Outlook]:
        """Every rank's ``Outlook`` as ``plan`` would see it now: what a decision was planned from."""
        shares = [1.0] * len(lengths) if shares is None else shares
        return self._views([self.cost_model.for_rank(r, share) for r, share in enumerate(shares)], lengths)

    def _views(self, models: Sequence[LatencyModel], lengths: Sequence[Sequence[int]]) -> list[Outlook]:
        density = self.cost_model.document_density
        return [outlook(model, ls, density(ls), self.p, self.min_density, self.raises_to_dense)
                for model, ls in zip(models, lengths)]

    def _targets(self, views: Sequence[Outlook], anchor: float, margin: float) -> list[float]:
        """Each rank's target time: its base time inside the deadband or with p = 0, else its ``target_time``
        (the anchor, less ``margin`` for a fast rank), damped by the cost model's ``confidence``.

        ``margin`` is how far the predictions of a step may be off; the deadband holds the base budgets while
        the predicted imbalance is within it.
        """
        base = np.array([v.base for v in views])
        if self.p <= 0 or imbalance(base) - 1.0 <= margin:
            return base.tolist()
        c = confidence(self.cost_model.error)
        goals = np.array([target_time(v, anchor, margin) for v in views])
        return (base + c * (goals - base)).tolist()

    def _anchor(self, views: Sequence[Outlook], lengths: Sequence[Sequence[int]], margin: float) -> float:
        if self.anchor == "adaptive":
            prices = [self.cost_model.recall_prices.prices(ls) for ls in lengths]
            anchor = adaptive_anchor(views, prices, self.recall_tolerance, margin)
        else:
            anchor = anchor_time([v.base for v in views], self.anchor)
        return reachable_anchor(views, anchor)

    def state_dict(self) -> dict[str, Any]:
        budgets = [[[b.tau, b.max_density, b.density_scale] for b in rank] for rank in self.budgets]
        return {"shifts": list(self.shifts), "budgets": budgets}

    def load_state_dict(self, state: Mapping[str, Any]) -> list[list[LayerBudget]]:
        """Restore; returns every rank's budgets of the last step before the checkpoint (empty if none). (A
        checkpoint's ``recall_slope``, one price for every length from before the cost model priced recall by
        length, is left out: the cost model learns prices again from the first step.)"""
        self.shifts = list(state["shifts"])
        self.budgets = [
            [LayerBudget(*(None if x is None else float(x) for x in row)) for row in rank] for rank in state["budgets"]
        ]
        return self.budgets


def check_settings(name: str, anchor: str, p: float, min_density: float, recall_tolerance: float) -> None:
    """One-line errors for DST settings that cannot work, naming the setting as ``name.setting``."""
    if anchor not in ANCHORS:
        raise ConfigError(f"{name}.anchor={anchor!r} is unknown; allowed: {', '.join(ANCHORS)}")
    if not 0.0 <= p <= 1.0:
        raise ConfigError(f"{name}.p={p} must lie in [0, 1]")
    if not 0.0 <= min_density <= 1.0:
        raise ConfigError(f"{name}.min_density={min_density} must lie in [0, 1]")
    if not 0.0 <= recall_tolerance <= 1.0:
        raise ConfigError(f"{name}.recall_tolerance={recall_tolerance} must lie in [0, 1]")
