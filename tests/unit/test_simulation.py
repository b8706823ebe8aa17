"""The cluster simulation: the real planner and DST controller over many ranks, with times predicted by the cost
model (its check against an emulated run is in tests/multiprocess/test_emulation.py)."""

import numpy as np
import pytest
from main_runner import REPO

from sparsebalance_pl import simulation
from sparsebalance_pl.cost import CostModel
from sparsebalance_pl.datamodules.sampler import BatchingConfig, SparsityAwareSampler
from sparsebalance_pl.datamodules.synthetic import LengthPrior
from sparsebalance_pl.dst import DSTController
from sparsebalance_pl.kernels.selection import LayerBudget
from sparsebalance_pl.model import PRESETS
from sparsebalance_pl.variants import VARIANTS, dst_settings


def test_the_h100_model_reproduces_the_figures_it_was_fitted_to():
    dims = PRESETS["qwen2.5-0.5b"].dims
    figures = simulation.h100_figures()
    report = (REPO / figures["source"]).read_text()  # the figures are the report's
    for key in ("attention_128k_s", "cudnn_attention_128k_s", "selection_128k_s", "model_32k_s"):
        assert f"{figures[key] * 1e3:.1f}" in report, key
    ours, cudnn = simulation.h100_latency(dims), simulation.h100_latency(dims, dense=True)
    parts = ours.breakdown([131072], 1.0)
    assert parts["attention"] / dims.num_layers == pytest.approx(figures["attention_128k_s"], rel=0.01)
    assert parts["selection"] / dims.num_layers == pytest.approx(figures["selection_128k_s"], rel=0.01)
    dense_32k = cudnn.breakdown([32768], 1.0)
    assert sum(v for k, v in dense_32k.items() if k != "selection") == pytest.approx(figures["model_32k_s"],
                                                                                      rel=0.05)


def test_the_density_law_passes_through_the_given_point():
    law = simulation.density_law(64, 0.27, 4096)
    assert law(np.array([4096.0]))[0] == pytest.approx(0.27)
    assert law(np.array([16384.0]))[0] < 0.27


def test_a_cluster_simulation_balances_where_the_baseline_cannot():
    dims = PRESETS["qwen2.5-0.5b"].dims
    lengths = LengthPrior.load("wlbllm").sample(800, np.random.default_rng(0), 32768)
    latency, density = simulation.h100_latency(dims), simulation.density_law(64, 0.6, 4096)

    def epoch(spec: str) -> dict:
        return simulation.simulate_variant(
            lengths, spec, dst_settings(spec, "mean", 0.1, 0.02), latency, density, num_layers=dims.num_layers,
            tau=0.9, ranks=16, max_tokens=32768, defer_window=8, prediction_error=0.06)

    static, balanced = epoch("static"), epoch("sparsebalance")
    assert static["removable_imbalance"] > 1.05
    assert min(static["tokens"], balanced["tokens"]) >= lengths.sum()  # every document, and the padding of a plan
    assert balanced["total_s"] < static["total_s"] and balanced["balance_efficiency"] > static["balance_efficiency"]
    assert static["rank_noise"] == pytest.approx(simulation.rank_noise_of_error(0.06))


def test_rank_noise_is_a_robust_spread_of_the_log_errors_within_each_step():
    rng = np.random.default_rng(0)
    steps = 0.2 * rng.standard_normal((500, 8)) + rng.normal(0.0, 1.0, (500, 1))  # a shift all ranks share
    assert simulation.rank_noise(steps.tolist()) == pytest.approx(0.2, rel=0.05)  # is not spread
    outlier = steps[:5].copy()
    outlier[0, 0] += 5.0
    assert simulation.rank_noise(outlier.tolist()) < 0.3  # one descheduled rank does not set it
    assert simulation.rank_noise([]) == 0.0 == simulation.rank_noise([[0.3]])
    assert simulation.rank_noise_of_error(0.6745 * 0.2) == pytest.approx(0.2)


def test_noisy_ranks_lengthen_balanced_steps_more_than_a_straggler_led_one():
    balanced, straggler = [[1.0] * 8], [[3.0] + [1.0] * 7]
    assert simulation.expected_epoch_seconds(balanced, 0.0) == 1.0
    noisy = simulation.expected_epoch_seconds(balanced, 0.1)
    assert 1.1 < noisy < 1.2  # E[max of 8 log-normals of spread 0.1] is about 1.15
    assert simulation.expected_epoch_seconds([[1.0] * 64], 0.1) > noisy  # more ranks, a worse slowest
    assert simulation.expected_epoch_seconds(straggler, 0.1) / 3.0 < noisy - 0.05
    assert simulation.epoch_summary(balanced, 100, 0.1)["exact_s"] == 1.0


def test_the_simulated_error_settles_to_the_ranks_noise_and_dst_then_acts():
    """A cost model started with a few calibration steps' large error learns, step by step, the error that the
    ranks' noise gives, as a live run's does; held at its start, it would keep DST damped all epoch."""
    dims = PRESETS["qwen2.5-0.5b"].dims
    lengths = LengthPrior.load("wlbllm").sample(400, np.random.default_rng(0), 32768)
    _, batching, _ = VARIANTS["dst"]

    def epoch(noise: float) -> tuple[float, float]:
        cost = CostModel(simulation.h100_latency(dims), simulation.density_law(64, 0.27, 4096))
        cost.error = 0.45
        controller = DSTController(cost, [LayerBudget(tau=0.9)] * dims.num_layers)
        plan = SparsityAwareSampler(lengths, BatchingConfig(method=batching, max_tokens=32768), cost_model=cost,
                                    seed=0, num_replicas=8, rank=0).plan()
        steps = simulation.predicted_epoch(plan, lengths, controller, noise)
        return cost.error, sum(max(s) for s in steps)

    (held_error, held_s), (settled_error, settled_s) = epoch(0.0), epoch(0.1)
    assert held_error == 0.45 and settled_error == pytest.approx(simulation.MEDIAN_ABS_NORMAL * 0.1, rel=0.5)
    assert settled_s < 0.99 * held_s  # trusted, DST brings the slowest ranks toward the anchor
