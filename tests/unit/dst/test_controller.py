"""DST's controller without Lightning: every rank's budgets from every rank's documents, and no harm done where
its predictions cannot be trusted."""

import numpy as np
import pytest

from sparsebalance_pl.cost import CostModel, DensityEstimator, SparsityReport, StepRecord
from sparsebalance_pl.dst import DSTController, confidence
from sparsebalance_pl.kernels import LayerBudget
from sparsebalance_pl.latency import LatencyModel
from sparsebalance_pl.model import PRESETS

TAU0 = 0.9
BASE = [LayerBudget(TAU0)] * 4
IMBALANCED = [[8192], [2048] * 4]  # same tokens, very different attention work
BALANCED = [[2048, 2048], [2048, 2048]]
MIXED = [[8192], [4096, 2048], [4096, 1024, 1024], [2048] * 3]


def _cost(error: float) -> CostModel:
    latency = LatencyModel.analytic(PRESETS["demo"].dims, block_size=64, stride=16)
    cost = CostModel(latency, DensityEstimator(block_size=64))
    cost.error = error
    return cost


def _moved(decision) -> bool:
    return any(budget.budgets != BASE for budget in decision.ranks)


def test_calibrated_model_moves_the_straggler_down_and_the_fast_rank_up():
    decision = DSTController(_cost(0.05), BASE, p=0.1).plan(IMBALANCED)
    slow, fast = decision.ranks
    assert slow.shift < 0 < fast.shift
    assert decision.predicted[0] < decision.predicted_base[0] and decision.predicted[1] > decision.predicted_base[1]
    assert max(decision.predicted) < max(decision.predicted_base)


def test_a_fast_rank_stops_short_of_the_anchor_by_the_prediction_error():
    """Overshooting would make it the straggler; the straggler itself still comes down to the anchor."""
    exact, cautious = (DSTController(_cost(error), BASE, p=0.3).plan(MIXED) for error in (0.0, 0.05))
    assert exact.anchor == pytest.approx(cautious.anchor)
    for r in (1, 2):  # below the anchor, with room up to it
        assert exact.predicted[r] == pytest.approx(exact.anchor)
        # the margin is the error on the timed share of the step, at most the error itself
        assert exact.anchor * np.exp(-0.05) <= cautious.predicted[r] < exact.predicted[r]
    c = confidence(0.05)
    expected = cautious.predicted_base[0] + c * (cautious.anchor - cautious.predicted_base[0])
    assert cautious.predicted[0] == pytest.approx(expected)


def test_no_move_within_the_prediction_error():
    # A step whose predicted imbalance is below what the predictions may be off by keeps the base budgets.
    assert not _moved(DSTController(_cost(0.05), BASE, p=0.1).plan(BALANCED))
    assert not _moved(DSTController(_cost(0.9), BASE, p=0.1).plan(IMBALANCED))
    assert _moved(DSTController(_cost(0.05), BASE, p=0.1).plan(IMBALANCED))


def test_moves_are_damped_while_the_model_is_uncertain():
    assert confidence(0.05) > 0.99 and confidence(0.3) == pytest.approx(0.5) and confidence(1.0) < 0.02
    sure = DSTController(_cost(0.05), BASE, p=0.1).plan(IMBALANCED)
    unsure = DSTController(_cost(0.25), BASE, p=0.1).plan(IMBALANCED)
    assert _moved(unsure)
    gap = [abs(d.predicted[0] - d.predicted_base[0]) for d in (sure, unsure)]
    assert gap[1] < 0.8 * gap[0]


def test_p_zero_is_the_static_baseline():
    decision = DSTController(_cost(0.0), BASE, p=0.0).plan(IMBALANCED)
    assert not _moved(decision) and decision.predicted == decision.predicted_base


def test_every_rank_reaches_the_same_decision_and_state():
    one, two = DSTController(_cost(0.05), BASE, p=0.1), DSTController(_cost(0.05), BASE, p=0.1)
    for _ in range(3):
        a, b = one.plan(IMBALANCED), two.plan(IMBALANCED)
        assert a == b
    assert one.state_dict() == two.state_dict()
    restored = DSTController(_cost(0.05), BASE, p=0.1)
    assert restored.load_state_dict(one.state_dict()) == one.budgets


def test_anchor_moves_at_most_twice_per_step_from_a_wrong_prior():
    """The analytic prior 10x too fast for a module: calibration converges over steps, and the anchor (a
    predicted time) never jumps by more than 2x from one step to the next."""
    cost = _cost(1.0)
    cost.error = 1.0
    truth = CostModel(LatencyModel(cost.latency.table.scaled([1.0, 10.0, 10.0, 1.0])))
    controller = DSTController(cost, BASE, p=0.1)
    anchors, drifts = [], []
    for _ in range(12):
        decision = controller.plan(IMBALANCED)
        anchors.append(decision.anchor)
        drifts.append(decision.anchor_drift)
        records = []
        for lengths, budget in zip(IMBALANCED, decision.ranks):
            density = float(cost.document_density(lengths).mean())
            seconds = truth.timed_seconds(lengths, density)
            report = SparsityReport([density] * 4, [0.9] * 4, [density] * len(lengths), seconds)
            records.append(StepRecord(lengths, report))
        cost.observe(records)
    ratios = np.array(anchors[1:]) / np.array(anchors[:-1])
    assert ratios.max() <= 2.0 + 1e-9 and ratios.min() >= 0.5 - 1e-9
    assert drifts[0] is None and np.allclose(drifts[1:], ratios)  # the same workload: the drift is the move
    assert anchors[-1] > 2 * anchors[0]  # and it did converge towards the slower truth
    assert cost.error < 0.5


def test_anchor_drift_leaves_out_the_change_of_workload():
    controller = DSTController(_cost(0.05), BASE, p=0.1)
    small = controller.plan(BALANCED).anchor
    decision = controller.plan(IMBALANCED)  # nothing learned in between
    assert decision.anchor > 1.5 * small and decision.anchor_drift == pytest.approx(1.0)


def _report(density: float, recall: float, base_density: float, base_recall: float) -> SparsityReport:
    return SparsityReport([density] * 4, [recall] * 4, [base_density], 0.1, base_density=[base_density] * 4,
                          base_estimated_recall=[base_recall] * 4)


def test_the_adaptive_anchor_prices_cuts_and_raises_apart_from_the_moves_made():
    """Ranks that moved report their base budget's density and recall beside their own, from which the cost
    model prices density on their documents: a raise that buys less recall than the straggler's cut costs holds
    the anchor up, one that buys more lets it come down at no predicted loss."""
    cost = _cost(0.05)
    controller = DSTController(cost, BASE, p=0.1, anchor="adaptive", recall_tolerance=0.0)
    even = controller.plan(MIXED).anchor  # the cautious prior: recall follows density

    def teach(cut: SparsityReport, raise_: SparsityReport) -> None:
        for _ in range(40):
            cost.recall_prices.observe([(ls, (cut if r == 0 else raise_).priced_moves()) for r, ls in enumerate(MIXED)])
    # per unit of log_move (0.3 ln(rho / 0.3)): cut 0.41, raise 0.29
    teach(_report(0.2, 0.85, 0.3, 0.90), _report(0.6, 0.96, 0.3, 0.90))
    assert controller.plan(MIXED).anchor > even  # raises buy less than cuts cost: a higher anchor keeps recall
    teach(_report(0.2, 0.85, 0.3, 0.90), _report(0.4, 0.99, 0.3, 0.90))  # raise: 1.04
    assert controller.plan(MIXED).anchor < even


