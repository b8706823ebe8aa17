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


class CellAccuracy(Metric):
    """Exact-match accuracy per named cell (for example ``passkey@4096``), summed over ranks."""

    full_state_update = False

    def __init__(self, cells: list[str]) -> None:
        super().__init__()
        self.cells = list(cells)
        self.add_state("correct", default=torch.zeros(len(cells), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.zeros(len(cells), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, cells: torch.Tensor, correct: torch.Tensor) -> None:
        self.correct.index_add_(0, cells, correct.double())
        self.total.index_add_(0, cells, torch.ones_like(correct, dtype=torch.float64))

    def compute(self) -> dict[str, torch.Tensor]:
        accuracy = (self.correct / self.total.clamp_min(1.0)).float()
        return {name: accuracy[i] for i, name in enumerate(self.cells) if self.total[i] > 0}
