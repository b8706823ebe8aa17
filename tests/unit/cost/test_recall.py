"""Recall prices by length: what the adaptive anchor weighs a move of density with."""

import json

import pytest

from sparsebalance_pl.cost import CostModel, RecallPrices, SparsityReport, StepRecord
from sparsebalance_pl.latency import LatencyModel
from sparsebalance_pl.cost.recall import length_class, log_move
from sparsebalance_pl.model import PRESETS


def _probed(cut: tuple[float, float], raise_: tuple[float, float]) -> SparsityReport:
    """An unmoved rank's report with its price probes' moves."""
    return SparsityReport([0.3] * 4, [0.9] * 4, [0.3], 0.1, recall=0.9, base_density=[0.3] * 4,
                          base_estimated_recall=[0.9] * 4, base_recall=0.9, probe_moves=[cut, raise_])


def test_a_pack_is_classed_by_where_its_tiles_lie():
    assert length_class([16384]) == 14 and length_class([2048] * 8) == 11
    assert length_class([16384, 512, 512]) == 13  # the long document holds nearly all the tiles
    assert length_class([]) == 0 and length_class([0, 1]) == 0


def _units(size: float, steps: int) -> float:
    """The units of ``log_move`` kept after ``steps`` equal moves of ``size`` (decay 0.95)."""
    return size * (1 - 0.95**steps) / 0.05


def _shrunk(*measured: tuple[float, float], toward: float) -> float:
    """The price of moves measured as (price, units) pairs, with 0.05 units more at the price ``toward``."""
    return (sum(price * units for price, units in measured) + 0.05 * toward) / (sum(u for _, u in measured) + 0.05)


def _size(base: float, moved: float) -> float:
    return abs(log_move(base, base + moved))


def test_a_move_is_sized_in_log_density():
    """Near the base a move's size is the density moved; far from it a cut counts more and a raise less."""
    assert log_move(0.3, 0.301) == pytest.approx(0.001, rel=1e-2)
    assert log_move(0.3, 0.15) == pytest.approx(-0.3 * 0.6931, rel=1e-4) and log_move(0.3, 0.15) < -0.15
    assert 0 < log_move(0.3, 0.9) < 0.6
    # Recall that follows log density at slope 0.2: a 0.55x cut and a 2x raise, moves of different sizes, are both
    # priced at that slope (per unit of density they would be 0.2 ln(0.55) / -0.45 = 0.27 and 0.2 ln 2 = 0.14).
    prices = RecallPrices(decay=1.0, prior_weight=1e-9)
    prices.observe([([4096], [(0.3, -0.135, 0.2 * log_move(0.3, 0.165)), (0.3, 0.3, 0.2 * log_move(0.3, 0.6))])])
    cut, raised = prices.prices([4096])
    assert cut == pytest.approx(0.2) and raised == pytest.approx(0.2)


def test_each_length_is_priced_from_its_own_packs_and_kept_while_others_are_measured():
    prices = RecallPrices()
    assert prices.prices([16384]) == (1.0, 1.0)  # nothing measured: the cautious prior
    for _ in range(60):
        prices.observe([([16384], [(0.3, -0.1, -0.03), (0.3, 0.2, 0.04)]), ([2048] * 8, [(0.3, -0.1, -0.01)])])
    cut, raise_ = _size(0.3, -0.1), _size(0.3, 0.2)
    long_cut, short_cut, long_raise = (0.03 / cut, _units(cut, 60)), (0.01 / cut, _units(cut, 60)), \
        (0.04 / raise_, _units(raise_, 60))
    pool = (_shrunk(long_cut, short_cut, toward=1.0), _shrunk(long_raise, toward=1.0))
    long = prices.prices([16384])
    assert long == pytest.approx((_shrunk(long_cut, toward=pool[0]), _shrunk(long_raise, toward=pool[1])))
    # no raise measured on short packs: the raises measured on others
    assert prices.prices([2048] * 8) == pytest.approx((_shrunk(short_cut, toward=pool[0]), pool[1]))
    assert prices.prices([512]) == pytest.approx(pool)  # a length never measured: the pool
    for _ in range(200):  # only short packs for a long while: the long ones keep their moments
        # a move below MIN_MOVE teaches nothing
        prices.observe([([2048] * 8, [(0.3, -0.1, -0.01), (0.3, 0.0005, 0.3)])])
    short_cut = (0.01 / cut, _units(cut, 260))
    pool = (_shrunk(long_cut, short_cut, toward=1.0), _shrunk(long_raise, toward=1.0))
    assert prices.prices([16384]) == pytest.approx((_shrunk(long_cut, toward=pool[0]), long[1]))
    assert prices.prices([2048] * 8) == pytest.approx((_shrunk(short_cut, toward=pool[0]), pool[1]))
    restored = RecallPrices()
    restored.load_state_dict(json.loads(json.dumps(prices.state_dict())))
    assert restored.prices([16384]) == prices.prices([16384]) and restored.moments.keys() == prices.moments.keys()


def test_a_class_measured_on_few_units_is_pulled_toward_the_pool_not_the_prior():
    """The calibration's probes measure a fraction of a unit per class; shrunk toward the prior 1.0 this class
    (0.10 units at 0.15) was priced 0.43."""
    prices = RecallPrices()
    for _ in range(40):
        prices.observe([([2048] * 8, [(0.15, -0.075, -0.15 * _size(0.15, -0.075))])])
    prices.observe([([16384], [(0.15, -0.075, -0.15 * _size(0.15, -0.075))])])
    assert prices.evidence()[14][0] == pytest.approx(_size(0.15, -0.075))  # 0.10 units
    assert prices.prices([16384])[0] == pytest.approx(0.15, rel=0.06)


def test_the_cost_model_learns_prices_from_steps_and_calibration_and_checkpoints_them():
    """Probes price density in steps where no rank moved, and a calibration pass prices before the first step."""
    cost = CostModel(LatencyModel.analytic(PRESETS["demo"].dims, block_size=64, stride=16))
    cost.observe_attention([StepRecord([16384], _probed((-0.15, -0.045), (0.3, 0.06)))])
    # one probe of each (base density 0.3), the only class: shrunk toward the prior 1.0 by twice 0.05 units
    size = _size(0.3, 0.3)  # a cut to half and a raise to double are the same size
    long_cut, long_raise = (0.045 / size, size), (0.06 / size, size)
    pool = _shrunk(long_cut, toward=1.0), _shrunk(long_raise, toward=1.0)
    assert cost.recall_prices.prices([16384]) == pytest.approx(
        (_shrunk(long_cut, toward=pool[0]), _shrunk(long_raise, toward=pool[1])))
    for _ in range(40):
        cost.observe([StepRecord([1024], _probed((-0.09, -0.027), (0.3, 0.04)))] * 4)
    cut, raised = cost.recall_prices.prices([1024])  # four ranks' probes a step
    short_cut, short_raise = (0.027 / _size(0.3, -0.09), 4 * _units(_size(0.3, -0.09), 40)), \
        (0.04 / size, 4 * _units(size, 40))
    pool = _shrunk(long_cut, short_cut, toward=1.0), _shrunk(long_raise, short_raise, toward=1.0)
    assert (cut, raised) == pytest.approx((_shrunk(short_cut, toward=pool[0]), _shrunk(short_raise, toward=pool[1])))
    moved = SparsityReport([0.2] * 4, [0.85] * 4, [0.3], 0.1, base_density=[0.3] * 4, base_estimated_recall=[0.9] * 4)
    # the estimate, where recall is not measured
    assert moved.priced_moves() == [pytest.approx((0.3, -0.1, -0.05))]
    restored = CostModel(LatencyModel.analytic(PRESETS["demo"].dims, block_size=64, stride=16))
    restored.load_state_dict(json.loads(json.dumps(cost.state_dict())))
    assert restored.recall_prices.prices([1024]) == (cut, raised)
