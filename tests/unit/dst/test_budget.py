"""The DST budget rule as pure functions: predicted times + latency model -> budgets."""

import numpy as np
import pytest

from sparsebalance_pl.kernels.selection import LayerBudget
from sparsebalance_pl.balance import imbalance
from sparsebalance_pl.dst import (
    adaptive_anchor,
    anchor_time,
    outlook,
    raises_to_dense,
    rank_budget,
    reachable_anchor,
    recall_drop,
    target_time,
)
from sparsebalance_pl.cost import CostModel
from sparsebalance_pl.latency import LatencyModel
from sparsebalance_pl.model import PRESETS

TAU0 = 0.9
BASE = [LayerBudget(TAU0, None)] * 4
LONG, SHORT = [4096], [512] * 8  # same tokens, very different attention work


@pytest.fixture(scope="module")
def model():
    return LatencyModel.analytic(PRESETS["demo"].dims, block_size=64, stride=16)


def _views(model, p, density=0.9):
    return [outlook(model, lengths, [density] * len(lengths), p) for lengths in (LONG, SHORT)]


@pytest.mark.parametrize("p", [0.05, 0.1, 0.2])
def test_straggler_goes_sparser_fast_rank_denser_within_p(model, p):
    views = _views(model, p)
    anchor = anchor_time([v.base for v in views], "mean")
    slow, fast = (rank_budget(v, anchor, p, BASE) for v in views)
    assert slow.shift < 0 < fast.shift
    for rb in (slow, fast):
        for b in rb.budgets:
            assert TAU0 <= b.tau <= min(TAU0 + p, 1.0) + 1e-9
    # The straggler keeps tau0 (a lower tau would cut deeper than its scale plans); the fast rank's rises.
    assert slow.budgets[0].tau == TAU0 < fast.budgets[0].tau
    # Kept tiles scale relative to the base selection: the straggler's down to its anchor time (not bounded
    # by p: the mean lies within its range here), the fast rank's ceiling at the anchor.
    assert views[0].low < anchor
    assert slow.budgets[0].max_density is None and fast.budgets[0].max_density is None
    assert slow.budgets[0].density_scale == pytest.approx(slow.density / views[0].density)
    assert model.predict(LONG, slow.density) == pytest.approx(anchor, rel=1e-6)
    assert views[1].density < fast.density <= views[1].density + p + 1e-9
    ceiling = fast.budgets[0].density_scale * views[1].density
    assert ceiling >= fast.density
    assert ceiling == pytest.approx(1.0) or model.predict(SHORT, ceiling) == pytest.approx(anchor)
    chosen = [v.at(anchor) for v in views]
    assert imbalance(chosen) < imbalance([v.base for v in views])


def test_straggler_stops_at_min_density(model):
    p = 0.1
    views = [outlook(model, lengths, [0.9] * len(lengths), p, min_density=0.6) for lengths in (LONG, SHORT)]
    anchor = anchor_time([v.base for v in views], "min")
    slow = rank_budget(views[0], anchor, p, BASE)
    assert views[0].floor == 0.6 and views[0].low > anchor
    assert slow.density == pytest.approx(0.6)
    assert slow.budgets[0].density_scale == pytest.approx(0.6 / views[0].density)
    assert slow.budgets[0].tau == TAU0


def test_per_row_base_cap_stays_for_a_straggler_and_rises_for_a_fast_rank(model):
    p = 0.1
    base = [LayerBudget(TAU0, 0.5)] * 4
    views = _views(model, p, density=0.5)
    anchor = anchor_time([v.base for v in views], "mean")
    slow, fast = (rank_budget(v, anchor, p, base) for v in views)
    assert slow.budgets[0].max_density == 0.5
    assert fast.budgets[0].max_density == pytest.approx(0.5 + fast.shift * p)


def test_static_budget_at_p_zero(model):
    views = _views(model, 0.0)
    rb = rank_budget(views[0], 0.0, 0.0, BASE)
    assert rb.shift == 0 and rb.budgets == BASE


def test_shift_moves_at_most_one_unit_per_step(model):
    p = 0.1
    views = _views(model, p)
    anchor = anchor_time([v.base for v in views], "min")
    free = rank_budget(views[0], anchor, p, BASE)
    limited = rank_budget(views[0], anchor, p, BASE, previous_shift=1.0)
    assert free.shift == pytest.approx(-1.0) and limited.shift == pytest.approx(0.0)


def test_anchors():
    times = [1.0, 2.0, 6.0]
    assert anchor_time(times, "mean") == 3.0
    assert anchor_time(times, "median") == 2.0
    assert anchor_time(times, "min") == 1.0 and anchor_time(times, "max") == 6.0
    with pytest.raises(ValueError):
        anchor_time(times, "adaptive")


def test_adaptive_anchor_trades_speed_for_recall(model):
    p = 0.1
    views = _views(model, p)  # the straggler first, then the fast rank
    fastest = min(v.base for v in views)
    # Cuts that cost no recall: the fastest step.
    assert adaptive_anchor(views, [(0.0, 1.0)] * 2, tolerance=0.0) == fastest
    # Recall that follows density and no allowance: the lowest anchor that loses no recall.
    even = [(1.0, 1.0)] * 2
    anchor = adaptive_anchor(views, even, tolerance=0.0)
    assert fastest < anchor < max(v.base for v in views)
    assert recall_drop(views, anchor, even) <= 0.0 < recall_drop(views, anchor * (1 - 1e-4), even)
    # An allowance buys a shorter step.
    allowed = adaptive_anchor(views, even, tolerance=0.01)
    assert allowed < anchor and recall_drop(views, allowed, even) == pytest.approx(0.01, abs=1e-6)
    # Raises that buy more recall per unit of density than cuts cost: a shorter step at no predicted loss;
    # raises that buy less: a longer one.
    assert adaptive_anchor(views, [(0.5, 1.0)] * 2, 0.0) < anchor < adaptive_anchor(views, [(1.0, 0.5)] * 2, 0.0)


def test_the_outlook_inverts_the_latency_model_as_the_budget_does(model):
    """The adaptive anchor's recall model reads a rank's density at an anchor off its outlook; ``rank_budget``
    takes its target from the latency model's exact inverse. They agree at every anchor in the rank's range."""
    lengths = [2048] * 2
    view = outlook(model, lengths, [0.3] * 2, 0.1, min_density=0.05, raises_to_dense=True)
    assert view.floor < view.density < view.top == 1.0 and list(view.times) == sorted(view.times)
    for anchor in np.linspace(view.low, view.high, 13):
        assert view.density_at(anchor) == pytest.approx(model.density_for(lengths, anchor, clip=True), abs=1e-6)
    assert view.density_at(view.base) == pytest.approx(view.density)


def test_adaptive_anchor_prices_each_rank_at_its_own_documents(model):
    """Only the straggler is cut and only the fast rank raised, so each move is priced at its own rank's price:
    a straggler whose documents lose more recall per unit cut holds the anchor higher, whatever the fast rank's
    cut price."""
    views = _views(model, 0.1)
    anchor = adaptive_anchor(views, [(0.5, 0.5)] * 2, tolerance=0.0)
    assert adaptive_anchor(views, [(0.5, 0.5), (5.0, 0.5)], 0.0) == pytest.approx(anchor)
    assert adaptive_anchor(views, [(0.8, 0.5), (0.5, 0.5)], 0.0) > anchor


def test_a_raise_that_keeps_every_candidate_is_priced_up_to_the_anchor(model):
    """With tau0 + p >= 1 a raised rank keeps every candidate block but for the scale's ceiling at the anchor's
    density (``rank_budget``): its outlook reaches dense, so the adaptive anchor prices the raise it will get,
    not one of p; the budgets themselves are the same either way."""
    p = 0.1
    assert raises_to_dense([LayerBudget(0.9)], p) and raises_to_dense([LayerBudget(0.95, 0.95)], p)
    assert not raises_to_dense([LayerBudget(0.85)], p) and not raises_to_dense([LayerBudget(0.9, 0.5)], p)
    assert not raises_to_dense([LayerBudget(0.9)], 0.0)
    lengths = [2048] * 2
    bounded, dense = (outlook(model, lengths, [0.3] * 2, p, raises_to_dense=d) for d in (False, True))
    assert bounded.top == pytest.approx(bounded.density + p) and dense.top == 1.0 and dense.high > bounded.high
    anchor = bounded.high * 1.5  # well above what a raise of p reaches
    assert bounded.density_at(anchor) == pytest.approx(bounded.density + p)
    assert dense.density_at(anchor) > bounded.density + 2 * p
    base = [LayerBudget(0.9)]
    moves = [rank_budget(view, anchor, p, base) for view in (bounded, dense)]
    assert moves[0].budgets == moves[1].budgets and moves[0].shift == moves[1].shift == 1.0
    assert moves[1].density == pytest.approx(model.density_for(lengths, anchor, clip=True))  # what it will keep
    static = outlook(model, lengths, [0.3] * 2, 0.0, raises_to_dense=True)
    assert static.top == static.density == static.floor


def test_only_fast_ranks_keep_a_margin_below_the_anchor(model):
    slow, fast = _views(model, 0.1)
    anchor = 0.5 * (slow.base + fast.base)
    assert target_time(slow, anchor, margin=0.1) == anchor
    assert target_time(fast, anchor, margin=0.1) == pytest.approx(anchor * np.exp(-0.1))
    assert target_time(fast, fast.base * 1.01, margin=0.1) == fast.base  # never below its own time
    assert target_time(fast, anchor) == anchor


def test_an_anchor_below_the_slowest_ranks_floor_is_raised_to_it(model):
    """With the straggler's floor above the mean, the mean anchor would keep the fast rank sparser than the
    step's time allows."""
    p = 0.2
    views = [outlook(model, lengths, [0.4] * len(lengths), p, min_density=0.35) for lengths in (LONG, [2048] * 2)]
    mean = anchor_time([v.base for v in views], "mean")
    straggler_floor = views[0].low
    assert mean < straggler_floor < views[0].base
    raised = reachable_anchor(views, mean)
    assert raised == straggler_floor
    assert max(v.at(raised) for v in views) == max(v.at(mean) for v in views)  # the same step
    assert views[1].density_at(raised) > views[1].density_at(mean)  # the fast rank denser
    assert reachable_anchor(views, views[0].base) == views[0].base


def test_speed_scales_only_the_timed_terms(model):
    cost = CostModel(model)
    cost.log_speeds = np.log([1.0, 2.0])
    slow = cost.for_rank(1)
    base, doubled = model.breakdown(LONG, 0.5), slow.breakdown(LONG, 0.5)
    assert doubled["attention"] == pytest.approx(2 * base["attention"])
    assert doubled["tokens"] == pytest.approx(base["tokens"])
    assert np.isclose(model.predict(LONG, 0.5), sum(base.values()))
