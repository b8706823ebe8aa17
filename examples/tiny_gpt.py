"""SparseBalance in a Lightning project of your own: a small GPT (plain torch.nn, not a Hugging Face model) trained
with sparsity-aware batching (SAB) and dynamic sparsity tuning (DST) on packed documents.

    python examples/tiny_gpt.py --steps 20 --out outputs/tiny_gpt             # 2 CPU ranks, DDP
    python examples/tiny_gpt.py --steps 20 --p 0 --out outputs/tiny_gpt_p0    # the same without tuning
    python examples/tiny_gpt.py --latency-table outputs/tiny_gpt_latency.json # a table profiled on first use

The module holds one ``SparseAttention`` as ``sparse_attention`` and calls ``attend`` in each attention layer; DST
and the batch-plan monitor are callbacks, and the sampler plans from the object's cost model.
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

from sparsebalance_pl.attention import AttentionConfig, SparseAttention
from sparsebalance_pl.callbacks import BatchPlanMonitor, DynamicSparsityTuning
from sparsebalance_pl.datamodules import BatchingConfig, PaddingItem, SparsityAwareSampler
from sparsebalance_pl.loss import globally_normalised_loss

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS, VOCAB = 128, 4, 2, 32, 256, 2, 256
MAX_TOKENS = 4096
#: What the cost model keys on; its prior counts a gated MLP of three matrices, this one has two: 2/3 of the width.
DIMS = {"num_layers": LAYERS, "hidden_size": HIDDEN, "num_heads": HEADS, "num_kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "intermediate_size": 2 * MLP // 3, "vocab_size": VOCAB}
ATTENTION = AttentionConfig(block_size=64, stride=16, tau=0.9)


class Block(nn.Module):
    """Pre-norm transformer block attending through the model's ``SparseAttention``."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        self.out = nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, MLP), nn.GELU(), nn.Linear(MLP, HIDDEN))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, sparse: SparseAttention) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q, k, v = (t.view(len(x), -1, HEAD_DIM) for t in (q, k, v))
        x = x + self.out(sparse.attend(self.index, q, k, v, cu_seqlens).reshape(len(x), -1))
        return x + self.mlp(self.norm2(x))


class TinyGPT(L.LightningModule):
    """A small GPT on packed documents; ``latency``: a table profiled for it, or None for the analytic prior."""

    def __init__(self, latency: Path | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(i) for i in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.sparse_attention = SparseAttention(DIMS, ATTENTION, latency)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, reported = self.loss(batch)
        self.log("train/loss", reported, prog_bar=True)
        return loss

    def loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to back-propagate, loss to report): SAB gives ranks unequal token counts, so each rank's summed
        loss is divided by the global count and every token weighs the same."""
        x = self.embed(batch["tokens"])
        for block in self.blocks:
            x = block(x, batch["cu_seqlens"], self.sparse_attention)
        loss_sum = F.cross_entropy(self.head(x), batch["targets"], ignore_index=-100, reduction="sum")
        return globally_normalised_loss(loss_sum, (batch["targets"] != -100).sum())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Documents(L.LightningDataModule):
    """Random-token documents of heavy-tailed lengths, packed by ``SparsityAwareSampler``."""

    def __init__(self, module: TinyGPT, count: int = 600, seed: int = 0) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.lengths = np.minimum(rng.lognormal(6.3, 1.1, count).astype(np.int64) + 64, MAX_TOKENS)
        self.documents = PaddedDocuments(rng.integers(0, VOCAB, n) for n in self.lengths)
        self.cost_model = module.sparse_attention.cost_model

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


def profile(table: Path) -> None:
    """Measure the module's latency table on this machine (run once in the launching process: the other ranks
    start after it and read the file)."""
    module, rng = TinyGPT(), np.random.default_rng(0)

    def step(lengths: list[int]) -> None:
        module.loss(pack([rng.integers(0, VOCAB, n) for n in lengths]))[0].backward()
        module.zero_grad(set_to_none=True)

    module.sparse_attention.profile(step, max_length=MAX_TOKENS, output=table)


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
    if args.latency_table is not None and not args.latency_table.exists():
        profile(args.latency_table)
    torch.manual_seed(0)  # after profiling, so every run starts from the same weights
    module = TinyGPT(args.latency_table)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.steps, use_distributed_sampler=False,
        callbacks=[DynamicSparsityTuning(p=args.p), BatchPlanMonitor()],
        logger=L.pytorch.loggers.CSVLogger(args.out, name="logs", version=0), log_every_n_steps=1,
        enable_checkpointing=False, enable_model_summary=False, default_root_dir=args.out,
    )
    trainer.fit(module, datamodule=Documents(module))
    if trainer.is_global_zero:
        rows = list(csv.DictReader(open(args.out / "logs" / "version_0" / "metrics.csv")))
        measured = [float(r["dst/measured_imbalance"]) for r in rows if r.get("dst/measured_imbalance")]
        print(f"mean measured attention imbalance over {len(measured)} steps: {np.mean(measured):.3f} (p={args.p})")


if __name__ == "__main__":
    main()
