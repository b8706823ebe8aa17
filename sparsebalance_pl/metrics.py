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
