"""A second, minimal LightningModule implementing the DST protocol, and a script that trains it on 2 CPU ranks.

The toy module's one 'attention layer' keeps about tau of its blocks (the near-uniform regime) and its
``SparseAttention`` reports a synthetic attention time (what the analytic latency model predicts for that density,
times the rank's slowdown), so multi-rank runs are deterministic and test the callback's logic rather than the
machine's noise.
Two-rank runs use DDP on the CPU in a subprocess (DDP inside pytest relaunches pytest itself in the children):
``python tests/helpers/minimal_tunable.py OUT --steps N --p P [--resume CKPT]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from sparsebalance_pl.attention import AttentionConfig, SparseAttention
from sparsebalance_pl.callbacks import DynamicSparsityTuning
from sparsebalance_pl.cost import CostModel, SparsityReport
from sparsebalance_pl.latency import LatencyModel
from sparsebalance_pl.model import PRESETS


TAU0 = 0.9
EQUAL = [[2048, 2048], [2048, 2048]]


DIMS = {**PRESETS["demo"].dims.as_dict(), "num_layers": 1}
TRUTH = CostModel(LatencyModel.analytic(DIMS, block_size=64, stride=16))  # the toy's attention 'takes' this


class SyntheticAttention(SparseAttention):
    """One layer's sparse attention that attends nowhere and reports ``synthetic``, set by the module each step."""

    synthetic: SparsityReport

    def report(self) -> SparsityReport:
        return self.synthetic


class MinimalTunable(L.LightningModule):
    """``SparsityTunable`` on a one-parameter model; rank r trains on ``workloads[r]`` every step, and its
    reported attention time is ``slowdown.get(r, 1)`` times the synthetic one (a slower rank)."""

    def __init__(self, workloads: list[list[int]], slowdown: dict[int, float] | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.workloads = workloads
        self.slowdown = slowdown or {}
        self.sparse_attention = SyntheticAttention(DIMS, AttentionConfig(tau=TAU0))
        self.history: list[tuple[int, float, float | None, float]] = []  # step, tau, cap, kept density

    def train_dataloader(self) -> DataLoader:
        lengths = self.workloads[self.global_rank % len(self.workloads)]
        cu_seqlens = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
        return DataLoader([{"cu_seqlens": cu_seqlens}] * 1000, batch_size=None)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        sparse = self.sparse_attention
        budget = sparse.budgets[0]
        scaled = TAU0 * budget.density_scale if budget.density_scale is not None else 1.0  # base keeps tau0
        density = min(budget.tau, budget.max_density or 1.0, scaled)
        lengths = sparse.document_lengths(batch)
        seconds = TRUTH.timed_seconds(lengths, density) * self.slowdown.get(self.global_rank, 1.0)
        sparse.begin(batch["cu_seqlens"])
        sparse.synthetic = SparsityReport([density], [density], [TAU0] * len(lengths), seconds)
        self.history.append((self.global_step, budget.tau, budget.max_density, density))
        return ((self.weight - density) ** 2).sum()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["cost_model"] = self.sparse_attention.cost_model.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.sparse_attention.cost_model.load_state_dict(checkpoint["cost_model"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer_for(tmp: Path, steps: int, callbacks: list, devices: int = 1, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=steps,
        callbacks=callbacks, logger=L.pytorch.loggers.CSVLogger(tmp, name="logs"), log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp, **kwargs,
    )


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--p", type=float)
    parser.add_argument("--resume")
    args = parser.parse_args()
    module = MinimalTunable(EQUAL, slowdown={1: 1.5})
    dst = DynamicSparsityTuning(anchor="mean", p=args.p)
    every = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=args.out / "checkpoints", every_n_train_steps=3, save_top_k=-1, filename="{step}"
    )
    trainer_for(args.out, args.steps, [dst, every], devices=2).fit(module, ckpt_path=args.resume)
    (args.out / f"history{module.global_rank}.json").write_text(json.dumps(module.history))


if __name__ == "__main__":
    _main()
