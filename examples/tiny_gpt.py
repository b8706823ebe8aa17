"""SparseBalance in a Lightning project of your own: a small GPT (plain torch.nn, not SparseQwen) trained with
sparsity-aware batching (SAB) and dynamic sparsity tuning (DST), using only public names.

    python examples/tiny_gpt.py --steps 20 --out outputs/tiny_gpt             # 2 CPU ranks, DDP
    python examples/tiny_gpt.py --steps 20 --p 0 --out outputs/tiny_gpt_p0    # the same without tuning
    python examples/tiny_gpt.py --latency-table outputs/tiny_gpt_latency.json # a table profiled on first use

What a module needs for DST (``sparsebalance_pl.callbacks.protocol``):
1. ``base_budgets`` and ``layer_budgets``: one ``LayerBudget`` per attention layer; DST replaces
   ``layer_budgets`` before every training micro-batch.
2. Attention that honours the whole budget: ``select_with_budget(q, k, cu_seqlens, layer_budgets[i],
   base_budgets[i], ...)`` then ``block_sparse_attention``, timed by an ``AttentionTimer`` (forward and backward,
   where no collective runs).
3. ``document_lengths(batch)``, and after each backward ``observe_step(cost_model, lengths, report)`` with a
   ``SparsityReport`` of what attention did: that is how the cost model (shared with DST and the sampler)
   learns this hardware and this module.
For SAB: a ``SparsityAwareSampler`` over the dataset's document lengths as the loader's ``batch_sampler``, with
``Trainer(use_distributed_sampler=False)``. The cost model starts from the analytic FLOP prior, or from a table
``profile_module`` measured for this module on this machine (its attention shape with the real kernels, the rest
from a few of its own steps), which DST can trust from the first step.
"""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from sparsebalance_pl.callbacks import (
    AttentionTimer,
    BatchPlanMonitor,
    CostModel,
    DynamicSparsityTuning,
    LayerBudget,
    SparsityReport,
    observe_step,
    select_with_budget,
)
from sparsebalance_pl.cost import DensityEstimator, LatencyModel
from sparsebalance_pl.cost.profiler import profile_module
from sparsebalance_pl.datamodules import BatchingConfig, PaddingItem, SparsityAwareSampler
from sparsebalance_pl.kernels import block_sparse_attention

DIMS = {"num_layers": 2, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32,
        "intermediate_size": 256, "vocab_size": 256}
BLOCK, STRIDE, TAU = 64, 16, 0.9
MAX_TOKENS = 4096


class Block(nn.Module):
    """Pre-norm transformer block whose attention is block-sparse under a ``LayerBudget``."""

    def __init__(self, index: int) -> None:
        super().__init__()
        h, self.heads, self.kv_heads, self.head_dim = (DIMS[k] for k in ("hidden_size", "num_heads", "num_kv_heads",
                                                                           "head_dim"))
        self.index = index
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv = nn.Linear(h, (self.heads + 2 * self.kv_heads) * self.head_dim)
        self.out = nn.Linear(self.heads * self.head_dim, h)
        self.mlp = nn.Sequential(nn.Linear(h, DIMS["intermediate_size"]), nn.GELU(),
                                 nn.Linear(DIMS["intermediate_size"], h))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, module: TinyGPT) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q, k, v = (t.view(len(x), -1, self.head_dim) for t in (q, k, v))

        def attend(q, k, v):
            selection = select_with_budget(q.detach(), k.detach(), cu_seqlens, module.layer_budgets[self.index],
                                           module.base_budgets[self.index], block_size=BLOCK, stride=STRIDE)
            module.selections[self.index] = selection
            return block_sparse_attention(q, k, v, selection.mask, cu_seqlens, block_size=BLOCK)

        attended = module.timer.timed(self.index, attend, q, k, v)
        x = x + self.out(attended.reshape(len(x), -1))
        return x + self.mlp(self.norm2(x))


class TinyGPT(L.LightningModule):
    """A small GPT on packed documents, tunable by ``DynamicSparsityTuning``."""

    def __init__(self, cost_model: CostModel) -> None:
        super().__init__()
        self.embed = nn.Embedding(DIMS["vocab_size"], DIMS["hidden_size"])
        self.blocks = nn.ModuleList(Block(i) for i in range(DIMS["num_layers"]))
        self.head = nn.Linear(DIMS["hidden_size"], DIMS["vocab_size"], bias=False)
        self.base_budgets = [LayerBudget(TAU) for _ in self.blocks]
        self.layer_budgets = list(self.base_budgets)
        self.cost_model = cost_model
        self.timer = AttentionTimer(torch.device("cpu"))
        self.selections: dict = {}
        self.lengths: list[int] = []

    def document_lengths(self, batch: dict) -> list[int]:
        return torch.diff(batch["cu_seqlens"]).tolist()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.timer, self.selections = AttentionTimer(self.device), {}
        self.lengths = self.document_lengths(batch)
        x = self.embed(batch["tokens"])
        for block in self.blocks:
            x = block(x, batch["cu_seqlens"], self)
        losses = F.cross_entropy(self.head(x), batch["targets"], ignore_index=-100, reduction="sum")
        return losses / max(int((batch["targets"] != -100).sum()), 1)

    def on_after_backward(self) -> None:
        selections = [self.selections[i] for i in sorted(self.selections)]
        report = SparsityReport(
            density=[float(s.stats.mean_density()) for s in selections],
            estimated_recall=[float(s.stats.mean_kept_mass()) for s in selections],
            base_document_density=torch.stack([s.base_document_density for s in selections]).mean(0).tolist(),
            attention_seconds=self.timer.seconds(),
            base_density=[float(s.base_stats.mean_density()) for s in selections],
            base_estimated_recall=[float(s.base_stats.mean_kept_mass()) for s in selections],
        )
        observe_step(self.cost_model, self.lengths, report)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Documents(L.LightningDataModule):
    """Random-token documents of heavy-tailed lengths, packed by ``SparsityAwareSampler``."""

    def __init__(self, cost_model: CostModel, count: int = 600, seed: int = 0) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.lengths = np.minimum(rng.lognormal(6.3, 1.1, count).astype(np.int64) + 64, MAX_TOKENS)
        self.documents = PaddedDocuments(rng.integers(0, DIMS["vocab_size"], n) for n in self.lengths)
        self.cost_model = cost_model

    def train_dataloader(self) -> DataLoader:
        batching = BatchingConfig(method="sab", max_tokens=MAX_TOKENS)
        sampler = SparsityAwareSampler(self.lengths, batching, cost_model=self.cost_model)  # rank from the group
        return DataLoader(self.documents, batch_sampler=sampler, collate_fn=pack)


def pack(documents) -> dict:
    """One stream: tokens, next-token targets within each document (-100 at its end) and ``cu_seqlens``."""
    tokens = torch.from_numpy(np.concatenate(documents))
    targets = torch.cat([torch.cat([torch.from_numpy(d[1:]), torch.tensor([-100])]) for d in documents])
    cu = torch.tensor(np.concatenate([[0], np.cumsum([len(d) for d in documents])]), dtype=torch.int32)
    return {"tokens": tokens, "targets": targets, "cu_seqlens": cu}


class PaddedDocuments(list):
    """The documents by index; a ``PaddingItem`` (a rank with nothing left in a step) becomes a one-token
    document, which bears no loss (its only target is the end of the document)."""

    def __getitem__(self, item):
        return super().__getitem__(item.index)[:1] if isinstance(item, PaddingItem) else super().__getitem__(item)


def latency_model(table: Path | None) -> LatencyModel:
    """The analytic prior without a table; with one, the table, profiled first when it is missing (run once in
    the launching process: the other ranks start after it and read the file)."""
    if table is None:
        return LatencyModel.analytic(DIMS, block_size=BLOCK, stride=STRIDE)
    if not table.exists():
        module = TinyGPT(CostModel(LatencyModel.analytic(DIMS, block_size=BLOCK, stride=STRIDE)))
        rng = np.random.default_rng(0)

        def step(lengths: list[int]) -> None:
            batch = pack([rng.integers(0, DIMS["vocab_size"], n) for n in lengths])
            module.training_step(batch, 0).backward()
            module.zero_grad(set_to_none=True)

        profile_module(DIMS, step, block_size=BLOCK, stride=STRIDE, max_length=MAX_TOKENS, output=table)
    return LatencyModel.from_file(table, DIMS, block_size=BLOCK, stride=STRIDE)


def build(p: float, latency: LatencyModel) -> tuple[TinyGPT, Documents, DynamicSparsityTuning]:
    """The module, data and DST callback of one run, sharing one cost model."""
    cost_model = CostModel(latency, DensityEstimator(block_size=BLOCK))
    data = Documents(cost_model)
    dst = DynamicSparsityTuning(p=p)
    dst.connect(cost_model)
    return TinyGPT(cost_model), data, dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--p", type=float, default=0.1, help="DST's bound on tau; 0 measures without tuning")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--latency-table", type=Path, help="a table for this module and machine (profiled when missing)")
    parser.add_argument("--out", type=Path, default=Path("outputs/tiny_gpt"))
    args = parser.parse_args()
    # Each rank its share of the cores, in the profile as in training: ranks that contend for every core slow down
    # at random, and the cost model would learn the contention instead of the work.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // args.devices))
    latency = latency_model(args.latency_table)
    torch.manual_seed(0)  # after profiling, so every run starts from the same weights
    module, data, dst = build(args.p, latency)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.steps, use_distributed_sampler=False, callbacks=[dst, BatchPlanMonitor()],
        logger=L.pytorch.loggers.CSVLogger(args.out, name="logs", version=0), log_every_n_steps=1,
        enable_checkpointing=False, enable_model_summary=False, default_root_dir=args.out,
    )
    trainer.fit(module, datamodule=data)
    if trainer.is_global_zero:
        rows = list(csv.DictReader(open(args.out / "logs" / "version_0" / "metrics.csv")))
        measured = [float(r["dst/measured_imbalance"]) for r in rows if r.get("dst/measured_imbalance")]
        print(f"mean measured attention imbalance over {len(measured)} steps: {np.mean(measured):.3f} (p={args.p})")


if __name__ == "__main__":
    main()
