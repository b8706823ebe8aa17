"""SparseCausalLM calibrates its cost model from its own steps, whether or not DST is attached."""

from dataclasses import replace

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from sparsebalance_pl.attention import AttentionConfig, SparseAttention
from sparsebalance_pl.callbacks import DynamicSparsityTuning
from sparsebalance_pl.cost import CostModel
from sparsebalance_pl.latency import LatencyModel
from sparsebalance_pl.cost.profiler import device_name
from sparsebalance_pl.cost.recall import length_class
from sparsebalance_pl.datamodules.packing import collate_packed
from sparsebalance_pl.model import ModelConfig
from sparsebalance_pl.module import OptimConfig, SparseCausalLM

TINY = {"num_layers": 2, "hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128}
HELD_OUT = [([1024], 0.3), ([256] * 4, 0.6), ([512, 128, 384], 0.9), ([896], 0.15)]


class SyntheticClock(SparseAttention):
    """Sparse attention that 'takes' what ``truth`` predicts for what the selection kept: the cost model's learning
    is then deterministic, and its error measurable against a known answer."""

    truth: CostModel

    def report(self):
        report = super().report()
        lengths = torch.diff(self.micro_batch.cu_seqlens).tolist()
        return replace(report, attention_seconds=self.truth.timed_seconds(lengths, report.mean_density))


def _batches(steps: int) -> list[dict]:
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(steps):
        cuts = np.sort(rng.choice(np.arange(64, 1024, 64), size=int(rng.integers(0, 4)), replace=False))
        lengths = np.diff(np.concatenate([[0], cuts, [1024]]))
        batches.append(collate_packed([{"tokens": rng.integers(0, 512, n)} for n in lengths]))
    return batches


def _held_out_error(cost: CostModel, truth: CostModel) -> float:
    return float(np.median([abs(cost.timed_seconds(n, d) / truth.timed_seconds(n, d) - 1) for n, d in HELD_OUT]))


def _fit(with_dst: bool, steps: int = 20) -> tuple[float, float, dict]:
    torch.manual_seed(0)
    module = SparseCausalLM(
        model=ModelConfig(preset="demo", overrides=TINY),
        attention=AttentionConfig(backend="sparse", block_size=64, stride=16, tau=0.9),
        optim=OptimConfig(lr=1e-3, warmup_steps=0),
    )
    clock = module.sparse_attention = SyntheticClock(module.dims, module.sparse_attention.config)
    clock.truth = CostModel(LatencyModel(clock.cost_model.latency.table.scaled([1.0, 2.5, 0.5, 1.0])))
    prior_error = _held_out_error(clock.cost_model, clock.truth)
    callbacks = [DynamicSparsityTuning(p=0.1)] if with_dst else []
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks)
    trainer.fit(module, DataLoader(_batches(steps), batch_size=None))
    return prior_error, _held_out_error(clock.cost_model, clock.truth), clock.cost_model.state_dict()


def test_a_run_without_dst_calibrates_as_well_as_one_with_it():
    prior, without_dst, state_without = _fit(with_dst=False)
    _, with_dst, state_with = _fit(with_dst=True)
    assert without_dst < prior / 3, (prior, without_dst)
    assert without_dst == pytest.approx(with_dst, rel=1e-6, abs=1e-9)
    assert state_without["latency"]["calibration"]["count"] == 19  # every step but the warm-up
    assert state_without["step_overhead"] > 0  # the optimiser's measured time, for SAB to weigh
    assert np.allclose(state_without["latency"]["calibration"]["log_scales"],
                       state_with["latency"]["calibration"]["log_scales"])


@pytest.mark.parametrize("recall_rows", [0, 64])
def test_the_report_prices_a_moved_budget_against_the_base_one(recall_rows):
    """With the layers' kept tiles cut to half of the base budget's, the report holds both: fewer tiles, less
    recall, and the base figures as a static step would report them. Where the module measures exact recall,
    the move is priced by it, the base budget's measured on the same rows."""
    torch.manual_seed(0)
    module = SparseCausalLM(model=ModelConfig(preset="demo", overrides=TINY),
                        attention=AttentionConfig(backend="sparse", block_size=64, stride=16, tau=0.6,
                                                  recall_rows=recall_rows))  # below 1 at the base: room to raise
    module.configure_model()
    batch = _batches(1)[0]
    module(batch)
    static = module.sparse_attention.report()
    module.sparse_attention.budgets = [replace(b, density_scale=0.5) for b in module.sparse_attention.base_budgets]
    module(batch)
    cut = module.sparse_attention.report()
    assert static.moved() == (0.0, 0.0)
    assert cut.base_density == pytest.approx(static.density) and cut.base_estimated_recall == pytest.approx(
        static.estimated_recall, abs=1e-4)
    density, recall = cut.moved()
    assert density < 0 and recall < 0
    assert not module.sparse_attention.micro_batch.selections  # each layer's selection was measured and let go
    if recall_rows:
        # (a layer after a moved one sees that layer's other output, so the base figures agree only closely)
        assert static.base_recall == static.recall and cut.base_recall == pytest.approx(static.recall, abs=1e-3)
        assert recall == pytest.approx(cut.recall - cut.base_recall)
        estimated = cut.mean_estimated_recall - sum(cut.base_estimated_recall) / len(cut.base_estimated_recall)
        assert recall != pytest.approx(estimated)
        # the price probes of the base budget, the same whatever budget is in use
        (cut_density, cut_recall), (raised_density, raised_recall) = static.probe_moves
        assert cut_density < 0 and cut_recall < 0 < raised_recall and raised_density > 0
        assert np.allclose(cut.probe_moves, static.probe_moves, atol=1e-3)
    else:
        assert cut.recall is None and cut.base_recall is None and cut.probe_moves is None


def test_density_calibration_prices_recall_by_length_before_the_first_step():
    """Where recall is measured, the calibration's forwards at the base budget also run the price probes, so
    the adaptive anchor's first move is priced on documents of its length and not by the prior."""
    torch.manual_seed(0)
    module = SparseCausalLM(model=ModelConfig(preset="demo", overrides=TINY),
                        attention=AttentionConfig(backend="sparse", block_size=64, stride=16, tau=0.6, recall_rows=64))
    module.configure_model()
    module.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                               enable_model_summary=False)
    rng = np.random.default_rng(0)
    packs = [[2048], [256] * 4]
    batches = [collate_packed([{"tokens": rng.integers(0, 512, n)} for n in pack]) for pack in packs]
    module.calibrate_density(batches)
    assert module.training and module.sparse_attention.cost_model.density.observed
    prices = module.sparse_attention.cost_model.recall_prices
    assert set(prices.moments) == {length_class(pack) for pack in packs}
    for pack in packs:  # measured: off the prior (1.0, 1.0); an untrained model's attention is near uniform
        cut, raised = prices.prices(pack)
        assert cut > 0 and raised > 0 and cut != 1.0 and raised != 1.0, (pack, cut, raised)


def test_density_calibration_runs_in_the_training_precision(monkeypatch):
    """The calibration's forwards select from the q and k training computes (bf16 under bf16-mixed), not fp32's."""
    module = SparseCausalLM(model=ModelConfig(preset="demo", overrides=TINY),
                            attention=AttentionConfig(block_size=64, stride=16, kernel_backend="torch"))
    module.configure_model()
    module.trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", logger=False,
                               enable_progress_bar=False, enable_model_summary=False)
    autocast, forward = [], SparseCausalLM.forward
    monkeypatch.setattr(SparseCausalLM, "forward",
                        lambda self, *args, **kwargs: autocast.append(torch.is_autocast_enabled("cpu"))
                        or forward(self, *args, **kwargs))
    rng = np.random.default_rng(0)
    module.calibrate_density([collate_packed([{"tokens": rng.integers(0, 512, 256)}])])
    assert autocast == [True]


class _Streams(L.LightningDataModule):
    """A data module whose longest stream is ``batching.max_tokens``, as ``LongContextDataModule``'s."""

    def __init__(self, max_tokens: int) -> None:
        super().__init__()
        self.batching = type("Batching", (), {"max_tokens": max_tokens})()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_batches(1), batch_size=None)


@pytest.mark.parametrize("table", [None, "table.json"])
def test_a_run_starts_from_a_table_reaching_its_longest_stream_or_the_prior_of_its_device(table, tmp_path, monkeypatch):
    asked = []

    def latency_model_for_run(path, config, kernels, **settings):
        asked.append(settings["max_length"])
        return LatencyModel.analytic(module.dims, block_size=kernels.block_size, stride=kernels.stride)

    monkeypatch.setattr("sparsebalance_pl.module.latency_model_for_run", latency_model_for_run)
    module = SparseCausalLM(model=ModelConfig(preset="demo", overrides=TINY),
                            attention=AttentionConfig(backend="sparse", block_size=64, stride=16),
                            latency_table=None if table is None else str(tmp_path / table))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, datamodule=_Streams(max_tokens=1024))
    meta = module.sparse_attention.cost_model.latency.table.meta
    if table is None:
        assert asked == [] and meta.source == "analytic" and meta.device == device_name("cpu")
    else:
        assert asked == [1024]  # the data module's longest stream, not the model's context length
