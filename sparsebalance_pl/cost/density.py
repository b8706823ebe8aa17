"""Estimate each document's attention density before it is seen, to predict its cost when planning batches.

At a fixed top-p threshold a query row keeps far fewer blocks than it could see once the row is long (sinks,
a local window and a few retrieved blocks), so a document's density falls with its length. The prior is
dense up to ``dense_blocks`` blocks and falls as a power of the block count beyond. Densities observed in
training then correct it per log-length bin (a running mean of log(observed / prior)), so the estimate
follows the model as its attention sharpens. Updates are deterministic: ranks fed the same all-gathered
observations, in the same order, hold identical estimates and so compute identical plans.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

ArrayLike = Sequence[float] | np.ndarray


class DensityEstimator:
    """Density by document length: a block-count prior times a learned per-bin correction.

    Args:
        block_size: tokens per attention block.
        dense_blocks: documents of up to this many blocks are predicted dense.
        exponent: beyond, density = (dense_blocks / blocks) ** exponent.
        min_density: floor of every estimate (the kernel always keeps the diagonal and first block).
        bins_per_octave: resolution of the learned correction in log2 of the length.
        max_length: lengths beyond share the last bin.
        memory: each bin averages over about this many most recent observations.
    """

    def __init__(
        self,
        *,
        block_size: int = 64,
        dense_blocks: float = 16.0,
        exponent: float = 0.5,
        min_density: float = 0.01,
        bins_per_octave: int = 2,
        max_length: int = 1 << 20,
        memory: float = 1000.0,
    ) -> None:
        if block_size < 1 or dense_blocks <= 0 or exponent < 0 or not 0 < min_density <= 1:
            raise ValueError("need block_size >= 1, dense_blocks > 0, exponent >= 0 and 0 < min_density <= 1")
        if bins_per_octave < 1 or max_length <= block_size or memory < 1:
            raise ValueError("need bins_per_octave >= 1, max_length > block_size and memory >= 1")
        self.block_size = block_size
        self.dense_blocks = float(dense_blocks)
        self.exponent = float(exponent)
        self.min_density = float(min_density)
        self.bins_per_octave = bins_per_octave
        self.memory = float(memory)
        self._log2_min = float(np.log2(block_size))
        num_bins = int(np.ceil((np.log2(max_length) - self._log2_min) * bins_per_octave))
        self._centers = self._log2_min + (np.arange(num_bins) + 0.5) / bins_per_octave
        self.log_ratio = np.zeros(num_bins)
        self.weight = np.zeros(num_bins)

    @property
    def observed(self) -> bool:
        """Whether any observation has corrected the prior yet."""
        return bool(self.weight.any())

    def prior(self, lengths: ArrayLike) -> np.ndarray:
        """The length-only density, before any observation."""
        blocks = np.ceil(_lengths(lengths) / self.block_size)
        return np.clip((self.dense_blocks / blocks) ** self.exponent, self.min_density, 1.0)

    def __call__(self, lengths: ArrayLike) -> np.ndarray:
        """Estimated density of each document: the prior times the learned correction of its length."""
        n = _lengths(lengths)
        seen = self.weight > 0
        if not seen.any():
            return self.prior(n)
        correction = np.interp(np.log2(n), self._centers[seen], self.log_ratio[seen])
        return np.clip(self.prior(n) * np.exp(correction), self.min_density, 1.0)

    def observe(self, lengths: ArrayLike, densities: ArrayLike) -> None:
        """Fold in the densities the model selected for documents of these lengths (same order on every rank)."""
        n = _lengths(lengths)
        rho = np.asarray(densities, dtype=np.float64)
        if rho.shape != n.shape or not np.all((rho > 0) & (rho <= 1)):
            raise ValueError("densities must match lengths and lie in (0, 1]")
        ratio = np.log(np.maximum(rho, self.min_density) / self.prior(n))
        index = np.clip(((np.log2(n) - self._log2_min) * self.bins_per_octave).astype(np.int64), 0, self.weight.size - 1)
        count = np.bincount(index, minlength=self.weight.size)
        total = np.bincount(index, weights=ratio, minlength=self.weight.size)
        hit = count > 0
        self.log_ratio[hit] += (total[hit] - count[hit] * self.log_ratio[hit]) / (self.weight[hit] + count[hit])
        self.weight[hit] = np.minimum(self.weight[hit] + count[hit], self.memory)

    def state_dict(self) -> dict[str, Any]:
        """The learned correction as plain lists (the prior comes from the constructor arguments)."""
        return {"log_ratio": self.log_ratio.tolist(), "weight": self.weight.tolist()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        log_ratio = np.asarray(state["log_ratio"], dtype=np.float64)
        weight = np.asarray(state["weight"], dtype=np.float64)
        if log_ratio.shape != self.log_ratio.shape or weight.shape != self.weight.shape:
            raise ValueError(
                f"density state has {log_ratio.size} bins, this estimator {self.log_ratio.size}: "
                "build it with the same block_size, bins_per_octave and max_length"
            )
        self.log_ratio, self.weight = log_ratio, weight


def _lengths(lengths: ArrayLike) -> np.ndarray:
    n = np.atleast_1d(np.asarray(lengths, dtype=np.float64))
    if n.ndim != 1 or not np.all(np.isfinite(n)) or np.any(n < 1):
        raise ValueError("document lengths must be a 1-D sequence of numbers >= 1")
    return n
