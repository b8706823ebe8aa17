"""Recall prices by length: what the adaptive anchor weighs a move of density with."""

import json

import pytest

from sparsebalance_pl.cost import CostModel, LatencyModel, RecallPrices, SparsityReport, StepRecord
from sparsebalance_pl.cost.recall import length_class
from sparsebalance_pl.model import PRESETS


def _probed(cut: tuple[float, float], raise_: tuple[float, float]) -> SparsityReport:
    """An unmoved rank's report with its price probes' moves."""
    return SparsityReport([0.3] * 4, [0.9] * 4, [0.3], 0.1, recall=0.9, base_density=[0.3] * 4,
                          base_estimated_recall=[0.9] * 4, base_recall=0.9, probe_moves=[cut, raise_])


def test_a_pack_is_classed_by_where_its_tiles_lie():
    assert length_class([16384]) == 14 and length_class([2048] * 8) == 11
    assert length_class([16384, 512, 512]) == 13  # the long document holds nearly all the tiles
    assert length_class([]) == 0 and length_class([0, 1]) == 0


def _shrunk(price: float, density: float, steps: int) -> float:
    """The price learned from ``steps`` equal moves of ``density``, shrunk toward the prior 1.0 by 0.05 units."""
    moved = density * (1 - 0.95**steps) / 0.05
    return (price * moved + 0.05) / (moved + 0.05)


def test_each_length_is_priced_from_its_own_packs_and_kept_while_others_are_measured():
    prices = RecallPrices()
    assert prices.prices([16384]) == (1.0, 1.0)  # never measured: the cautious prior
    for _ in range(60):
        prices.observe([([16384], [(-0.1, -0.03), (0.2, 0.04)]), ([2048] * 8, [(-0.1, -0.01)])])
    long = prices.prices([16384])
    assert long == pytest.approx((_shrunk(0.3, 0.1, 60), _shrunk(0.2, 0.2, 60)))
    assert prices.prices([2048] * 8) == pytest.approx((_shrunk(0.1, 0.1, 60), 1.0))  # no raise measured there
    for _ in range(200):  # only short packs for a long while: the long ones keep their price
        prices.observe([([2048] * 8, [(-0.1, -0.01), (0.0005, 0.3)])])  # a move below MIN_MOVE teaches nothing
    assert prices.prices([16384]) == long
    assert prices.prices([2048] * 8) == pytest.approx((_shrunk(0.1, 0.1, 260), 1.0))
    restored = RecallPrices()
    restored.load_state_dict(json.loads(json.dumps(prices.state_dict())))
    assert restored.prices([16384]) == long and restored.moments.keys() == prices.moments.keys()


def test_the_cost_model_learns_prices_from_steps_and_calibration_and_checkpoints_them():
    """Probes price density in steps where no rank moved, and a calibration pass prices before the first step."""
    cost = CostModel(LatencyModel.analytic(PRESETS["demo"], block_size=64, stride=16))
    cost.observe_attention([StepRecord([16384], _probed((-0.15, -0.045), (0.3, 0.06)))])
    # one probe of each, shrunk toward the prior 1.0 by 0.05 units of density
    assert cost.recall_prices.prices([16384]) == pytest.approx((0.095 / 0.2, 0.11 / 0.35))
    for _ in range(40):
        cost.observe([StepRecord([1024], _probed((-0.09, -0.027), (0.3, 0.04)))] * 4)
    cut, raised = cost.recall_prices.prices([1024])  # four ranks' probes a step
    assert (cut, raised) == pytest.approx((_shrunk(0.3, 0.36, 40), _shrunk(0.4 / 3, 1.2, 40)))
    moved = SparsityReport([0.2] * 4, [0.85] * 4, [0.3], 0.1, base_density=[0.3] * 4, base_estimated_recall=[0.9] * 4)
    assert moved.priced_moves() == [pytest.approx((-0.1, -0.05))]  # the estimate, where recall is not measured
    restored = CostModel(LatencyModel.analytic(PRESETS["demo"], block_size=64, stride=16))
    restored.load_state_dict(json.loads(json.dumps(cost.state_dict())))
    assert restored.recall_prices.prices([1024]) == (cut, raised)
