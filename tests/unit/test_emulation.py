"""Emulated ranks in one process: the step's bookkeeping (unit level; tests/multiprocess/test_emulation.py checks
the emulation against a real 2-process run)."""

import copy
import dataclasses
import math
import time

import numpy as np
import pytest
import torch

from sparsebalance_pl.attention import AttentionConfig
from sparsebalance_pl.datamodules.packing import collate_packed
from sparsebalance_pl.emulation import EmulatedRanks, allreduce_seconds
from sparsebalance_pl.model import ModelConfig
from sparsebalance_pl.module import OptimConfig, SparseCausalLM

TINY = {"num_layers": 1, "hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128}


@pytest.fixture
def module():
    torch.manual_seed(0)
    module = SparseCausalLM(model=ModelConfig(preset="demo", overrides=TINY),
                        attention=AttentionConfig(backend="sparse", block_size=64, stride=16, tau=0.9),
                        optim=OptimConfig(lr=1e-3, warmup_steps=0))
    module.configure_model()
    return module


def _batch(seed: int, lengths=(256, 128)) -> dict:
    rng = np.random.default_rng(seed)
    return collate_packed([{"tokens": rng.integers(0, 512, n)} for n in lengths])


def test_a_step_times_every_rank_and_counts_what_it_ran(module):
    ranks = EmulatedRanks(module, 3, total_steps=4, gradient_clip=1.0)
    step = ranks.step([[_batch(r), _batch(r + 10, (64,))] for r in range(3)])
    assert len(step.rank_seconds) == 3 and all(s > 0 for s in step.rank_seconds)
    assert step.seconds == max(step.rank_seconds) + step.optimizer_seconds
    assert step.tokens == 3 * (384 + 64) and step.lengths[1] == [[256, 128], [64]]
    assert len(step.round_losses) == 2 == len(step.observations) and math.isfinite(step.loss)
    assert min(step.round_losses) <= step.loss <= max(step.round_losses)


def test_a_ranks_time_leaves_out_the_measurement_of_recall(module, monkeypatch):
    """Recall's measurement (``recall_rows``) is the benchmark's instrumentation: it is timed apart and a rank's
    time does not hold it, so a slow measurement leaves the rank's time as it was."""
    import sparsebalance_pl.attention as attention

    module.sparse_attention.config = dataclasses.replace(module.sparse_attention.config, recall_rows=16)
    measure = attention._measure_recall

    def slow_measure(*args, **kwargs):
        time.sleep(0.3)
        measure(*args, **kwargs)

    monkeypatch.setattr(attention, "_measure_recall", slow_measure)
    ranks = EmulatedRanks(module, 2, total_steps=4)
    started = time.perf_counter()
    step = ranks.step([[_batch(0)], [_batch(1)]], update=False)
    wall = time.perf_counter() - started
    reports = [record.report for record in step.observations[0].records]
    assert all(r.recall is not None and r.measurement_seconds >= 0.3 for r in reports)
    assert wall >= 0.6 and sum(step.rank_seconds) < wall - 0.55


def test_repeated_runs_time_the_median_and_keep_one_runs_gradients(module):
    """With ``repeats`` a rank's time is the median of its runs, and the update is the one a single run gives."""
    batches = [[_batch(0)], [_batch(1, (128, 64))]]
    gradients = {}

    def run(repeats: int):
        ranks = EmulatedRanks(copy.deepcopy(module), 2, total_steps=4, repeats=repeats)
        parameters = list(ranks.module.parameters())
        ranks._update = lambda finite: gradients.setdefault(repeats, [p.grad.clone() for p in parameters])
        return ranks.step(batches)

    once, thrice = run(1), run(3)
    assert [len(draws) for draws in thrice.rank_draws] == [3, 3] and [len(d) for d in once.rank_draws] == [1, 1]
    assert thrice.rank_seconds == [sorted(draws)[1] for draws in thrice.rank_draws]
    assert thrice.loss == pytest.approx(once.loss, rel=1e-6)
    for a, b in zip(gradients[3], gradients[1]):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="repeats=0"):
        EmulatedRanks(module, 2, total_steps=4, repeats=0)


def test_ranks_must_hold_the_same_number_of_micro_batches(module):
    ranks = EmulatedRanks(module, 2, total_steps=4)
    with pytest.raises(ValueError, match=r"same number .* got \[1, 2\]"):
        ranks.step([[_batch(0)], [_batch(1), _batch(2)]])
    with pytest.raises(ValueError, match=r"got \[0, 0\]"):
        ranks.step([[], []])
    with pytest.raises(ValueError, match="needs 2 ranks"):
        ranks.step([[_batch(0)]])
    with pytest.raises(ValueError, match="gradient_clip_algorithm"):
        EmulatedRanks(module, 2, total_steps=4, gradient_clip_algorithm="l2")


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_a_step_with_a_non_finite_loss_drops_its_update(module):
    ranks = EmulatedRanks(module, 2, total_steps=4)
    with torch.no_grad():
        module.net.hf.lm_head.weight[0, 0] = float("nan")  # tied to the embedding: every loss is NaN
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    step = ranks.step([[_batch(0)], [_batch(1)]])
    assert math.isnan(step.loss)
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0, equal_nan=True, msg=name)
        assert p.grad is None, name
    assert ranks.scheduler.last_epoch == 1  # the schedule moved on


def test_the_allreduce_estimate_is_a_ring_of_the_gradients():
    assert allreduce_seconds(10**9, 1, 50.0) == 0.0
    assert allreduce_seconds(10**9, 8, 50.0) == pytest.approx(2 * 7 / 8 * 4e9 / 50e9)
    with pytest.raises(ValueError):
        allreduce_seconds(10**9, 0, 50.0)


def test_a_step_without_update_teaches_the_cost_model_and_leaves_the_weights(module):
    ranks = EmulatedRanks(module, 2, total_steps=4)
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    step = ranks.step([[_batch(0)], [_batch(1)]], update=False)
    assert step.optimizer_seconds == 0.0 and math.isfinite(step.loss)
    for name, p in module.named_parameters():
        assert torch.equal(p.detach(), before[name]) and p.grad is None, name
    cost_model = module.sparse_attention.cost_model
    assert ranks.scheduler.last_epoch == 0 and cost_model.overheads_observed == 0
    assert cost_model.warmup_left == 0 and cost_model.last_step is step.observations[-1]


def test_a_step_keeps_each_ranks_predicted_time_from_the_controller(module):
    from sparsebalance_pl.dst import DSTController

    without = EmulatedRanks(module, 2, total_steps=4).step([[_batch(0)], [_batch(1)]], update=False)
    assert all(math.isnan(s) for s in without.predicted_seconds)
    sparse = module.sparse_attention
    controller, decisions = DSTController(sparse.cost_model, sparse.base_budgets, p=0.0), []
    plan = controller.plan
    controller.plan = lambda lengths: decisions.append(plan(lengths)) or decisions[-1]
    batches = [[_batch(0), _batch(2, (64,))], [_batch(1), _batch(3, (64,))]]
    step = EmulatedRanks(module, 2, total_steps=4, controller=controller).step(batches, update=False)
    # each rank's predictions of both micro-batch rounds add up, as its measured times do
    assert len(decisions) == 2 and all(s > 0 for s in step.predicted_seconds)
    assert step.predicted_seconds == pytest.approx([sum(d.predicted[r] for d in decisions) for r in range(2)])
