"""A batch sampler that hands each rank its micro-batches of a plan every rank computes alike.

Lightning's distributed sampler is switched off (``use_distributed_sampler=False``): every rank computes the
same epoch plan from (seed, epoch, document lengths) with no communication, and takes its own column of it.
The plan has the same number of micro-batches on every rank, so collectives never wait on a missing rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
from torch.utils.data import Sampler

from sparsebalance_pl.datamodules.packing import first_fit


class PaddingItem(NamedTuple):
    """A document fed only to keep a rank in step with the others: it bears no loss."""

    index: int


def first_fit_plan(
    lengths: np.ndarray, *, max_tokens: int, num_ranks: int, seed: int, epoch: int, shuffle: bool
) -> list[list[list]]:
    """steps x ranks x document indices: first-fit packing in (shuffled) stream order, dealt out in turn.

    Training (``shuffle``) drops the micro-batches of an incomplete last step: the next epoch reshuffles them.
    Evaluation must see every document once, so ranks left without a micro-batch in the last step get a
    ``PaddingItem`` (the shortest document, bearing no loss) instead.
    """
    order = np.random.default_rng([seed, epoch]).permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    batches = first_fit(lengths, order, max_tokens)
    if not shuffle and len(batches) % num_ranks:
        padding = [PaddingItem(int(np.argmin(lengths)))]
        batches += [padding] * (num_ranks - len(batches) % num_ranks)
    steps = len(batches) // num_ranks
    return [batches[s * num_ranks : (s + 1) * num_ranks] for s in range(steps)]


class PlannedBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches (lists of dataset indices) of the current epoch's plan."""

    def __init__(
        self,
        lengths: np.ndarray,
        *,
        max_tokens: int,
        num_ranks: int,
        rank: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank {rank} outside 0..{num_ranks - 1}")
        self.lengths = np.asarray(lengths)
        self.max_tokens = max_tokens
        self.num_ranks = num_ranks
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self._plan: list[list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self._plan = None

    def plan(self) -> list[list[list[int]]]:
        if self._plan is None:
            self._plan = first_fit_plan(
                self.lengths,
                max_tokens=self.max_tokens,
                num_ranks=self.num_ranks,
                seed=self.seed,
                epoch=self.epoch,
                shuffle=self.shuffle,
            )
        return self._plan

    def __iter__(self) -> Iterator[list[int]]:
        for step in self.plan():
            yield step[self.rank]

    def __len__(self) -> int:
        return len(self.plan())
