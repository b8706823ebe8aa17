"""DynamicSparsityTuning with a second, minimal LightningModule implementing the protocol.

The toy module's one 'attention layer' keeps about tau of its blocks (the near-uniform regime) and reports
a synthetic attention time (what the analytic latency model predicts for that density, times the rank's
slowdown), so multi-rank runs are deterministic and test the callback's logic rather than this shared
machine's noise. Two-rank runs use DDP on the CPU in a subprocess
(DDP inside pytest relaunches pytest itself in the children), running this file as a script.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from sparsebalance_pl.callbacks import DynamicSparsityTuning, LayerBudget, SparsityReport, SparsityTunable
from sparsebalance_pl.cost import CostModel, DensityEstimator, observe_step
from sparsebalance_pl.latency import LatencyModel
from sparsebalance_pl.model import PRESETS

TAU0 = 0.9
EQUAL = [[2048, 2048], [2048, 2048]]


def _analytic() -> LatencyModel:
    return LatencyModel.analytic(PRESETS["demo"], block_size=64, stride=16)


TRUTH = CostModel(_analytic())  # the toy's attention 'takes' what this predicts


class MinimalTunable(L.LightningModule):
    """``SparsityTunable`` on a one-parameter model; rank r trains on ``workloads[r]`` every step, and its
    reported attention time is ``slowdown.get(r, 1)`` times the synthetic one (a slower rank)."""

    def __init__(self, workloads: list[list[int]], slowdown: dict[int, float] | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.workloads = workloads
        self.slowdown = slowdown or {}
        self.base_budgets = [LayerBudget(TAU0)]
        self.layer_budgets = [LayerBudget(TAU0)]
        self.cost_model = CostModel(_analytic(), DensityEstimator(block_size=64))
        self.history: list[tuple[int, float, float | None, float]] = []  # step, tau, cap, kept density
        self._step: tuple[list[int], SparsityReport] | None = None

    def train_dataloader(self) -> DataLoader:
        lengths = torch.tensor(self.workloads[self.global_rank % len(self.workloads)])
        return DataLoader([{"lengths": lengths}] * 1000, batch_size=None)

    def document_lengths(self, batch: dict) -> list[int]:
        return batch["lengths"].tolist()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        budget = self.layer_budgets[0]
        scaled = TAU0 * budget.density_scale if budget.density_scale is not None else 1.0  # base keeps tau0
        density = min(budget.tau, budget.max_density or 1.0, scaled)
        lengths = batch["lengths"].tolist()
        seconds = TRUTH.timed_seconds(lengths, density) * self.slowdown.get(self.global_rank, 1.0)
        self._step = (lengths, SparsityReport([density], [density], [TAU0] * len(lengths), seconds))
        self.history.append((self.global_step, budget.tau, budget.max_density, density))
        return ((self.weight - density) ** 2).sum()

    def on_after_backward(self) -> None:
        observe_step(self.cost_model, *self._step)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["cost_model"] = self.cost_model.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.cost_model.load_state_dict(checkpoint["cost_model"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _dst(module: MinimalTunable, **settings) -> DynamicSparsityTuning:
    dst = DynamicSparsityTuning(**settings)
    dst.connect(module.cost_model)
    return dst


def _trainer(tmp: Path, steps: int, callbacks: list, devices: int = 1, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=steps,
        callbacks=callbacks, logger=L.pytorch.loggers.CSVLogger(tmp, name="logs"), log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp, **kwargs,
    )


def test_protocol_is_checked(tmp_path):
    assert isinstance(MinimalTunable(EQUAL), SparsityTunable)

    class Plain(L.LightningModule):
        pass

    assert not isinstance(Plain(), SparsityTunable)
    with pytest.raises(TypeError, match="Plain lacks layer_budgets, base_budgets, document_lengths"):
        DynamicSparsityTuning().on_fit_start(None, Plain())
    with pytest.raises(RuntimeError, match="no cost model"):
        DynamicSparsityTuning().on_fit_start(None, MinimalTunable(EQUAL))


def test_single_rank_keeps_base_budget_and_logs(tmp_path):
    module = MinimalTunable(EQUAL)
    dst = _dst(module, anchor="adaptive")
    _trainer(tmp_path, 3, [dst]).fit(module)
    assert [(tau, cap) for _, tau, cap, _ in module.history] == [(TAU0, None)] * 3
    assert "dst/rank0/tau" in module.trainer.logged_metrics
    state = dst.state_dict()
    assert set(state) == {"recall_slope", "shifts", "budgets"}
    json.dumps(state)  # plain data
    restored = _dst(module, anchor="adaptive")
    restored.load_state_dict(json.loads(json.dumps(state)))
    restored.on_fit_start(module.trainer, module)
    assert restored.state_dict() == state


def _run_two_ranks(out: Path, *args: str) -> None:
    command = [sys.executable, __file__, str(out), *args]
    path = os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=out, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


def _history(out: Path) -> dict[int, list]:
    return {r: json.loads((out / f"history{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.slow
def test_slow_rank_gets_sparser_then_balanced_and_resumes_identically(tmp_path):
    """A rank whose attention is 1.5x slower (imbalance 1.2), default p: while the cost model has not yet
    learned the rank's speed beyond its own error, DST holds the base budgets (no harm from an uncalibrated
    model); then the slow rank's budget falls (tau by p, its tile scale further, from the cost model), the
    measured imbalance drops below 1.1 within 20 steps without oscillating, tau stays in [tau0 - p, tau0 + p]
    and moves by at most p per step; a run resumed from the step-3 checkpoint chooses the same budgets as the
    uninterrupted one."""
    p = 0.1
    first, second = tmp_path / "first", tmp_path / "resumed"
    first.mkdir(), second.mkdir()
    _run_two_ranks(first, "--steps", "20", "--p", str(p))
    runs = _history(first)
    rows = list(csv.DictReader(open(first / "logs/version_0/metrics.csv")))
    imbalance = [float(r["dst/measured_imbalance"]) for r in rows if r.get("dst/measured_imbalance")]
    assert imbalance[0] > 1.15 and max(imbalance[-3:]) < 1.1, imbalance
    taus = {r: [tau for _, tau, *_ in runs[r]] for r in runs}
    assert taus[1][-1] < TAU0 < taus[0][-1]
    density = [d for *_, d in runs[1]]  # what the toy keeps
    assert density[-1] < TAU0 - p  # in this near-uniform regime the scale, not tau, balances
    assert all(b <= a + 1e-9 for a, b in zip(density, density[1:]))  # never oscillates
    assert density[0] == density[1] == TAU0  # held while the prediction error exceeds the predicted imbalance
    for series in taus.values():
        assert all(TAU0 - p - 1e-9 <= t <= TAU0 + p + 1e-9 for t in series)
        assert all(abs(a - b) <= p + 1e-9 for a, b in zip(series, series[1:]))

    checkpoint = next((first / "checkpoints").glob("*step=3.ckpt"))
    _run_two_ranks(second, "--steps", "6", "--p", str(p), "--resume", str(checkpoint))
    resumed = _history(second)
    for r in (0, 1):
        assert resumed[r] == [entry for entry in runs[r] if 3 <= entry[0] < 6]


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--p", type=float)
    parser.add_argument("--resume")
    args = parser.parse_args()
    module = MinimalTunable(EQUAL, slowdown={1: 1.5})
    dst = _dst(module, anchor="mean", p=args.p)
    every = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=args.out / "checkpoints", every_n_train_steps=3, save_top_k=-1, filename="{step}"
    )
    _trainer(args.out, args.steps, [dst, every], devices=2).fit(module, ckpt_path=args.resume)
    (args.out / f"history{module.global_rank}.json").write_text(json.dumps(module.history))


if __name__ == "__main__":
    _main()
