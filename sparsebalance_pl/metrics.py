"""Torchmetrics aggregates that must be exact across ranks with unequal amounts of data."""

from __future__ import annotations

import torch
from torchmetrics import Metric


class TokenMeanLoss(Metric):
    """Mean loss per loss-bearing token over all batches and ranks (not a mean of per-batch means)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("loss_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, loss_sum: torch.Tensor, tokens: torch.Tensor) -> None:
        self.loss_sum += loss_sum.detach().double()
        self.tokens += tokens.detach().double()

    def compute(self) -> torch.Tensor:
        return (self.loss_sum / self.tokens.clamp_min(1.0)).float()


class CellMeans(Metric):
    """Mean of named scores per named cell (for example ``f1`` per ``hotpotqa@0-4k``), summed over ranks.

    A sample may count towards several cells (its dataset and its dataset and length bucket, say).
    """

    full_state_update = False

    def __init__(self, cells: list[str], scores: list[str]) -> None:
        super().__init__()
        self.cells = list(cells)
        self.scores = list(scores)
        shape = (len(self.cells), len(self.scores))
        self.add_state("sums", default=torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.zeros(len(self.cells), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, cells: torch.Tensor, values: torch.Tensor) -> None:
        """``cells`` [n] or [n, m]: the cell(s) of each of n samples; ``values`` [n, len(scores)]."""
        per_sample = cells.shape[1] if cells.ndim == 2 else 1
        self.sums.index_add_(0, cells.reshape(-1), values.double().repeat_interleave(per_sample, dim=0))
        self.total.index_add_(0, cells.reshape(-1), torch.ones(cells.numel(), dtype=torch.float64, device=cells.device))

    def compute(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{score: {cell: mean}}``, leaving out cells without samples."""
        means = (self.sums / self.total.clamp_min(1.0)[:, None]).float()
        present = [i for i in range(len(self.cells)) if self.total[i] > 0]
        return {score: {self.cells[i]: means[i, s] for i in present} for s, score in enumerate(self.scores)}


class CellAccuracy(CellMeans):
    """Exact-match accuracy per named cell (for example ``passkey@4096``), summed over ranks."""

    def __init__(self, cells: list[str]) -> None:
        super().__init__(cells, ["accuracy"])

    def update(self, cells: torch.Tensor, correct: torch.Tensor) -> None:
        super().update(cells, correct[:, None])

    def compute(self) -> dict[str, torch.Tensor]:
        return super().compute()["accuracy"]
