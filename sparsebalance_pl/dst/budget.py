"""The budget rule of dynamic sparsity tuning, as pure functions of predicted times.

Every rank predicts its micro-batch's time at the base budget and at the ends of its allowed range, the
ranks share these few numbers, and all agree on an anchor time A. Each rank then moves toward A: its
density target is the density at which its predicted time equals A. The move becomes a ``LayerBudget``:

- a fast rank's tau rises by the same amount as its density target, up to tau0 + p; it sets the accuracy
  floor where attention is sharp. A straggler's tau stays at tau0 and its scale alone cuts: a lower tau would
  make the per-row top-p keep fewer tiles than the scale allows, cutting deeper than the move the cost model
  priced and planned;
- ``density_scale`` bounds the layer's kept tiles relative to what the base budget keeps there, by the
  ratio of the density at which the rank would reach the anchor to its base density: it is what
  guarantees the time. A straggler's scale is not bounded by p (its target goes down to a floor,
  ``min_density``): where attention is near-uniform tau barely moves cost, and where it is sharp the scale
  cuts the blocks of least mass. A fast rank's scale is a ceiling at the anchor: where attention is sharp
  a small rise of tau keeps many more blocks (tau = 1 keeps them all) and would overshoot. Being relative
  to the layer's own base selection, the scale does not depend on how well the base density was
  estimated, which an absolute cap does (a cap below the true base density makes a fast rank sparser);
- a per-row base cap (``max_density``) stays for a straggler and moves up with tau for a fast rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from sparsebalance_pl.cost.latency import LatencyModel
from sparsebalance_pl.cost.recall import log_move
from sparsebalance_pl.kernels import LayerBudget

Anchor = Literal["mean", "median", "min", "max", "adaptive"]
ANCHORS: tuple[str, ...] = ("mean", "median", "min", "max", "adaptive")
#: The anchors that are a fixed statistic of the ranks' predicted base times.
FIXED_ANCHORS: tuple[str, ...] = ("min", "median", "mean", "max")


@dataclass(frozen=True)
class Outlook:
    """One rank's predicted seconds for its micro-batch: at the base budget and over the range it may move in.

    ``density`` is the effective base density rho0 (the uniform density predicting ``base``); ``low`` is
    the predicted time at the sparsest density the rank may take (``floor``), ``high`` the one at the densest
    (``top``). ``densities`` and ``times`` are the latency model's ``time_curve`` for the rank's documents, so
    the densities a move is priced at (``density_at``) and the ones its budget targets (``rank_budget``) are
    the same exact inverse (a straight line from the base to the range's ends was off by up to 0.05 of density
    on the analytic model, ``tests/unit/dst/test_budget.py``).
    """

    base: float
    low: float
    high: float
    density: float
    tokens: float
    floor: float
    top: float
    densities: tuple[float, ...]
    times: tuple[float, ...]

    def at(self, anchor: float) -> float:
        """Predicted seconds once the budget moved toward ``anchor``."""
        return min(max(anchor, self.low), self.high)

    def density_for(self, seconds: float) -> float:
        """The density whose predicted time is ``seconds``, within the model's density range (as
        ``LatencyModel.density_for`` clipped)."""
        return float(np.interp(seconds, self.times, self.densities))

    def density_at(self, anchor: float) -> float:
        """The density once the budget moved toward ``anchor``, within the rank's range."""
        return self.density_for(self.at(anchor))


def outlook(
    model: LatencyModel,
    lengths: Sequence[int],
    base_density: Sequence[float],
    p: float,
    min_density: float = 0.0,
    raises_to_dense: bool = False,
) -> Outlook:
    """This rank's ``Outlook`` for documents of ``lengths`` with estimated base densities ``base_density``;
    its cap may go down to ``min_density`` (at least the model's smallest density; with p = 0 it stays), and up
    to rho0 + p, or to dense where ``raises_to_dense``: where the raised tau keeps every candidate block
    (``raises_to_dense``), only the scale's ceiling bounds a raise, at the anchor's density (``rank_budget``)."""
    base = model.predict(lengths, base_density)
    densities, times = model.time_curve(lengths)
    rho0 = float(np.interp(base, times, densities))
    floor = rho0 if p <= 0 else min(max(min_density, model.min_density), rho0)
    top = rho0 if p <= 0 else 1.0 if raises_to_dense else min(rho0 + p, 1.0)
    low, high = (float(np.interp(d, densities, times)) for d in (floor, top))
    return Outlook(base, min(low, base), max(high, base), rho0, float(sum(lengths)), floor, top,
                   tuple(densities.tolist()), tuple(times.tolist()))


def raises_to_dense(base: Sequence[LayerBudget], p: float) -> bool:
    """Whether a full raise (tau and the per-row cap up by p) keeps every candidate block in every layer."""
    return p > 0 and all(b.tau + p >= 1.0 - 1e-9 and _cap(b.max_density, 1.0, p) is None for b in base)


def anchor_time(times: Sequence[float], anchor: str) -> float:
    """The anchor of the fixed kinds (``FIXED_ANCHORS``) over the ranks' predicted base times."""
    reduce = {"mean": np.mean, "median": np.median, "min": np.min, "max": np.max}
    if anchor not in reduce:
        raise ValueError(f"anchor={anchor!r} is not one of {FIXED_ANCHORS}")
    return float(reduce[anchor](np.asarray(times, dtype=np.float64)))


def target_time(view: Outlook, anchor: float, margin: float = 0.0) -> float:
    """The time a rank aims at: the anchor; for a rank below it, the anchor less the relative ``margin`` (how far
    predictions may be off), but not below its base time.

    Errors cost unevenly: a fast rank that overshoots becomes the straggler every rank waits for, one that
    stops short loses only the recall of a little density.
    """
    if view.base >= anchor:
        return anchor
    return max(view.base, anchor * math.exp(-margin))


def recall_drop(
    outlooks: Sequence[Outlook], anchor: float, prices: Sequence[tuple[float, float]], margin: float = 0.0
) -> float:
    """Predicted token-weighted loss of recall against the base budget once every rank moved toward ``anchor``
    (fast ranks to ``target_time``); ``prices``: per rank, the recall its documents lose per unit cut and gain
    per unit raised (``RecallPrices.prices``, units of ``log_move``)."""
    tokens = np.array([o.tokens for o in outlooks])
    change = np.array([log_move(o.density, o.density_at(target_time(o, anchor, margin))) for o in outlooks])
    cut, raised = np.asarray(prices, dtype=np.float64).T
    gained = cut * np.minimum(change, 0.0) + raised * np.maximum(change, 0.0)
    return float(-(tokens * gained).sum() / max(tokens.sum(), 1.0))


def adaptive_anchor(
    outlooks: Sequence[Outlook], prices: Sequence[tuple[float, float]], tolerance: float, margin: float = 0.0
) -> float:
    """The lowest anchor, between the fastest and the slowest rank's base time, whose predicted recall loss is
    within ``tolerance`` (fast ranks aiming at ``target_time`` with ``margin``).

    The step lasts as long as the slowest rank; a lower anchor shortens it but makes stragglers sparser and
    fast ranks less dense. ``prices`` (per rank, recall lost per unit cut and gained per unit raised, in units of
    ``log_move``, both at least 0, as measured on documents of its lengths) say what that costs. The predicted
    loss falls as the anchor rises and is at most 0 at the slowest base time (no rank gets sparser), so bisection
    finds the lowest anchor within the allowance; where no cut costs recall, recall does not favour a higher
    anchor, and it is the fastest.
    """
    base = [o.base for o in outlooks]
    low, high = min(base), max(base)
    if max(cut for cut, _ in prices) <= 0 or recall_drop(outlooks, low, prices, margin) <= tolerance:
        return low
    while high - low > 1e-6 * high:
        middle = 0.5 * (low + high)
        if recall_drop(outlooks, middle, prices, margin) <= tolerance:
            high = middle
        else:
            low = middle
    return high


def reachable_anchor(outlooks: Sequence[Outlook], anchor: float) -> float:
    """``anchor``, raised to the longest time any rank takes at its sparsest (never above the slowest base time).

    The step cannot end before that rank does, so an anchor below it would hold the faster ranks at budgets
    sparser than the step's time allows, losing recall and gaining nothing.
    """
    return max(anchor, max(o.low for o in outlooks))


@dataclass(frozen=True)
class RankBudget:
    """A rank's move: ``shift`` in [-1, 1] units of p, the density it aims at, and the per-layer budgets."""

    shift: float
    density: float
    budgets: list[LayerBudget]


def rank_budget(
    view: Outlook,
    anchor: float,
    p: float,
    base: Sequence[LayerBudget],
    previous_shift: float | None = None,
) -> RankBudget:
    """This rank's budgets for moving its predicted time toward ``anchor`` (module docstring).

    The density target inverts the latency model exactly (``Outlook.density_at``). After the first step the shift
    moves by at most 1 from ``previous_shift``, so tau cannot oscillate by more than p; tau follows only a
    positive shift (a straggler keeps tau0).
    With p = 0 the base budgets are returned unchanged (the static baseline).
    """
    if p <= 0:
        return RankBudget(0.0, view.density, [replace(b) for b in base])
    target = max(view.density_at(anchor), view.floor)
    shift = float(np.clip((target - view.density) / p, -1.0, 1.0))
    if previous_shift is not None:
        shift = float(np.clip(shift, previous_shift - 1.0, previous_shift + 1.0))
    taus = [min(b.tau + max(shift, 0.0) * p, 1.0) for b in base]
    if abs(target - view.density) <= 1e-9:  # at the anchor already: tau may still be settling back
        return RankBudget(shift, target, [replace(b, tau=tau) for tau, b in zip(taus, base)])
    ceiling = target if target < view.density else view.density_for(anchor)
    scale = ceiling / view.density
    budgets = [LayerBudget(tau, _cap(b.max_density, shift, p), scale) for tau, b in zip(taus, base)]
    return RankBudget(shift, target, budgets)


def _cap(base_cap: float | None, shift: float, p: float) -> float | None:
    """The per-row base cap: a straggler keeps it, a fast rank's moves up with tau (module docstring)."""
    if base_cap is None or shift <= 0:
        return base_cap
    moved = base_cap + shift * p
    return None if moved >= 1.0 else moved
