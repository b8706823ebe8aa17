"""A batch sampler that hands each rank its micro-batches of a plan every rank computes alike.

Lightning's distributed sampler is switched off (``use_distributed_sampler=False``): every rank computes the
same epoch plan from (seed, epoch, document lengths, predicted costs) with no communication, and takes its
own column of it. The plan has the same number of micro-batches on every rank, so collectives never wait on
a missing rank; a rank with nothing left in a step gets a ``PaddingItem`` that bears no loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from torch.utils.data import Sampler

from sparsebalance_pl.balance import balance_efficiency, imbalance
from sparsebalance_pl.datamodules.packing import first_fit
from sparsebalance_pl.datamodules.planner import CostFn, PlannerConfig, plan_epoch


class PaddingItem(NamedTuple):
    """A document fed only to keep a rank in step with the others: it bears no loss."""

    index: int


@dataclass(frozen=True)
class StepPlan:
    """One optimiser step: ``micro_batches[rank][micro]`` lists of items, with predicted cost and tokens."""

    micro_batches: list[list[list]]
    costs: np.ndarray  # [ranks] predicted seconds summed over the rank's micro-batches
    tokens: np.ndarray  # [ranks]

    @property
    def imbalance(self) -> float:
        return imbalance(self.costs)


EpochPlan = list[StepPlan]


def first_fit_plan(
    lengths: np.ndarray, costs: np.ndarray, *, max_tokens: int, num_ranks: int, seed: int, epoch: int, shuffle: bool
) -> EpochPlan:
    """The token-count baseline: first-fit packing in (shuffled) stream order, micro-batches dealt in turn.

    Training (``shuffle``) drops the micro-batches of an incomplete last step: the next epoch reshuffles them.
    Evaluation must see every document once, so ranks left without a micro-batch in the last step get a
    ``PaddingItem`` (the shortest document, bearing no loss) instead.
    """
    order = np.random.default_rng([seed, epoch]).permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    batches: list[list] = first_fit(lengths, order, max_tokens)
    if not shuffle and len(batches) % num_ranks:
        batches += [[_padding(lengths)]] * (num_ranks - len(batches) % num_ranks)
    steps = len(batches) // num_ranks
    return [
        _step([[batch] for batch in batches[s * num_ranks : (s + 1) * num_ranks]], lengths, costs)
        for s in range(steps)
    ]


def sparsity_aware_plan(lengths: np.ndarray, cost_fn: CostFn, config: PlannerConfig, epoch: int) -> EpochPlan:
    """Sparsity-aware batching: global batches partitioned into micro-batches of equal predicted time."""
    return [
        StepPlan(
            [[[segment.doc for segment in mb] or [_padding(lengths)] for mb in per_rank] for per_rank in batch.micro_batches],
            batch.costs.sum(axis=0),
            batch.tokens.sum(axis=0),
        )
        for batch in plan_epoch(lengths, cost_fn, config, epoch)
    ]


def plan_efficiency(plan: EpochPlan) -> float:
    """Predicted balance efficiency (``balance.balance_efficiency``) of a plan, from each step's per-rank costs."""
    return balance_efficiency(step.costs for step in plan)


def _padding(lengths: np.ndarray) -> PaddingItem:
    return PaddingItem(int(np.argmin(lengths)))


def _step(micro_batches: list[list[list]], lengths: np.ndarray, costs: np.ndarray) -> StepPlan:
    def total(values: np.ndarray, per_rank: list[list]) -> float:
        return float(sum(values[i] for mb in per_rank for i in mb if not isinstance(i, PaddingItem)))

    return StepPlan(
        micro_batches,
        np.array([total(costs, r) for r in micro_batches]),
        np.array([total(lengths, r) for r in micro_batches]),
    )


class PlannedBatchSampler(Sampler[list]):
    """Yields this rank's micro-batches of the current epoch's plan; a resumed epoch starts at ``skip``."""

    def __init__(self, plan_fn: Callable[[int], EpochPlan], *, rank: int, epoch: int = 0, skip: int = 0) -> None:
        self.plan_fn = plan_fn
        self.rank = rank
        self.epoch = epoch
        self.skip = skip
        self._plan: EpochPlan | None = None

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self._plan = None

    def plan(self) -> EpochPlan:
        if self._plan is None:
            self._plan = self.plan_fn(self.epoch)
        return self._plan

    def __iter__(self) -> Iterator[list]:
        skip, self.skip = self.skip, 0  # only the resumed epoch skips the micro-batches already consumed
        mine = (mb for step in self.plan() for mb in step.micro_batches[self.rank])
        for position, micro_batch in enumerate(mine):
            if position >= skip:
                yield micro_batch

    def __len__(self) -> int:
        return sum(len(step.micro_batches[self.rank]) for step in self.plan())
