"""Batch samplers that hand each rank its micro-batches of a plan every rank computes alike.

Lightning's distributed sampler is switched off (``Trainer(use_distributed_sampler=False)``): every rank
computes the same epoch plan from (seed, epoch, document lengths, predicted costs) with no communication, and
takes its own column of it. The plan has the same number of micro-batches on every rank, so collectives never
wait on a missing rank; a rank with nothing left in a step gets a ``PaddingItem`` that bears no loss.
``SparsityAwareSampler`` is the public one, for any map-style dataset whose documents' lengths are known.

Context parallelism: with groups of W neighbouring ranks, a plan is made for the groups, each one slot of W
times a rank's tokens, and ``group_plan`` hands a group's micro-batch to its ranks: split over them as plain
data parallelism when every document fits one rank, or, when one does not, to all of them as one stream marked
by a ``SharedStream`` item, which the group trains block-striped with ring attention.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple

import numpy as np
from torch.utils.data import Sampler

from sparsebalance_pl.balance import balance_efficiency, imbalance
from sparsebalance_pl.datamodules.packing import first_fit
from sparsebalance_pl.datamodules.partition import CapacityError, partition
from sparsebalance_pl.cost import CostModel
from sparsebalance_pl.datamodules.planner import CostFn, PlannerConfig, plan_epoch
from sparsebalance_pl.distributed import rank as process_rank
from sparsebalance_pl.distributed import world_size
from sparsebalance_pl.errors import ConfigError


@dataclass
class BatchingConfig:
    """How training documents become per-rank micro-batches.

    Args:
        method: ``sab`` (sparsity-aware: micro-batches of equal predicted time) or ``first_fit`` (the token-count
            baseline).
        max_tokens: most tokens in one micro-batch on one rank (memory; at least ``corpus.max_doc_tokens``).
        tokens_per_rank: with ``sab``, the token budget of a global batch per rank (default ``max_tokens``).
            Smaller budgets leave headroom up to ``max_tokens`` but cut smaller global batches, where the
            costliest single document caps balance more often.
        defer_window: with ``sab``, the most steps an outlier document may be deferred (0: never), which lets
            balance pass the single-step cap set by the costliest document.
        micro_batches: micro-batches per rank and optimiser step; must equal ``trainer.accumulate_grad_batches``.
        num_workers: dataloader worker processes per rank.
    """

    method: Literal["sab", "first_fit"] = "sab"
    max_tokens: int = 4096
    tokens_per_rank: int | None = None
    defer_window: int = 0
    micro_batches: int = 1
    num_workers: int = 0

    def __post_init__(self) -> None:
        if self.method not in ("sab", "first_fit"):
            raise ConfigError(f"data.batching.method={self.method!r} is unknown; allowed: 'sab', 'first_fit'")
        if self.defer_window < 0 or self.micro_batches < 1:
            raise ConfigError(
                f"data.batching.defer_window={self.defer_window} must be >= 0 and data.batching.micro_batches="
                f"{self.micro_batches} >= 1"
            )

    @property
    def rank_budget(self) -> int:
        """Tokens per rank in a global batch's budget: ``tokens_per_rank``, or ``max_tokens`` when unset."""
        return self.tokens_per_rank or self.max_tokens

    def for_group(self, size: int) -> "BatchingConfig":
        """The batching of one slot of a plan made for context-parallel groups of ``size`` ranks: ``size``
        times a rank's tokens and budget."""
        return replace(self, max_tokens=size * self.max_tokens, tokens_per_rank=size * self.rank_budget)



class PaddingItem(NamedTuple):
    """A document fed only to keep a rank in step with the others: it bears no loss."""

    index: int


class SharedStream(NamedTuple):
    """Leads a micro-batch that a context-parallel group of ``size`` ranks trains together as one stream."""

    size: int


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

    Every document is used once per epoch, as with SAB (and as Lightning's sampler pads rather than drops by
    default): ranks left without a micro-batch in the last step get a ``PaddingItem`` (the shortest document,
    bearing no loss). Dropping that step instead would leave the baseline up to ``num_ranks - 1`` micro-batches
    less work per epoch than the planner it is compared with.
    """
    order = np.random.default_rng([seed, epoch]).permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    batches: list[list] = first_fit(lengths, order, max_tokens)
    if len(batches) % num_ranks:
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


def _share(micro_batch: list) -> float:
    """The part of a micro-batch's documents one rank computes: 1 / W of a group's shared stream."""
    return 1.0 / micro_batch[0].size if micro_batch and isinstance(micro_batch[0], SharedStream) else 1.0


def plan_efficiency(plan: EpochPlan) -> float:
    """Predicted balance efficiency (``balance.balance_efficiency``) of a plan, from each step's per-rank costs."""
    return balance_efficiency(step.costs for step in plan)


def _padding(lengths: np.ndarray) -> PaddingItem:
    return PaddingItem(int(np.argmin(lengths)))


def group_plan(plan: EpochPlan, lengths: np.ndarray, costs: np.ndarray, *, group_size: int, rank_tokens: int) -> EpochPlan:
    """A plan made for context-parallel groups (one slot per group) as the plan of their ranks: each micro-batch
    of a group is partitioned over its ``group_size`` ranks when every document fits one rank's
    ``rank_tokens``, and otherwise goes whole to every rank of the group behind a ``SharedStream``. A rank
    left without documents gets a ``PaddingItem``; every rank keeps the group's number of micro-batches."""
    if group_size == 1:
        return plan
    steps = []
    for step in plan:
        ranks: list[list[list]] = [[] for _ in range(len(step.micro_batches) * group_size)]
        for slot, micro_batches in enumerate(step.micro_batches):
            for micro_batch in micro_batches:
                parts = _group_micro_batch(micro_batch, lengths, costs, group_size, rank_tokens)
                for member, part in enumerate(parts):
                    ranks[slot * group_size + member].append(part)
        steps.append(_step(ranks, lengths, costs))
    return steps


def _group_micro_batch(items: list, lengths: np.ndarray, costs: np.ndarray, group_size: int, rank_tokens: int):
    """The micro-batch of each rank of a group (see ``group_plan``)."""
    docs = [i for i in items if not isinstance(i, PaddingItem)]
    if docs and max(lengths[docs]) <= rank_tokens:
        try:
            parts = partition(costs[docs], group_size, tokens=lengths[docs], capacity=rank_tokens)
            return [[docs[j] for j in part] or [_padding(lengths)] for part in parts]
        except CapacityError:  # no packing on single ranks: the group shares the stream
            pass
    return [[SharedStream(group_size), *items] for _ in range(group_size)]


def _step(micro_batches: list[list[list]], lengths: np.ndarray, costs: np.ndarray) -> StepPlan:
    def total(values: np.ndarray, per_rank: list[list]) -> float:
        return float(sum(values[i] * _share(mb) for mb in per_rank for i in mb if isinstance(i, (int, np.integer))))

    return StepPlan(
        micro_batches,
        np.array([total(costs, r) for r in micro_batches]),
        np.array([total(lengths, r) for r in micro_batches]),
    )


class PlannedBatchSampler(Sampler[list]):
    """Yields this rank's micro-batches of the current epoch's plan.

    Resume through ``state_dict``/``load_state_dict``: the state is the epoch (``set_epoch``); where training
    stood in it is the training loop's count, not the sampler's, which runs ahead of training when batches are
    prefetched, so ``load_state_dict`` takes it as ``batches_consumed`` beside the state.
    """

    def __init__(self, plan_fn: Callable[[int], EpochPlan], *, rank: int) -> None:
        self.plan_fn = plan_fn
        self.rank = rank
        self.epoch = 0
        self.resume_at: tuple[int, int] | None = None  # (epoch, micro-batches of it consumed) until it is iterated
        self._plan: EpochPlan | None = None

    @property
    def sampler(self) -> "PlannedBatchSampler":
        """Itself: Lightning names each epoch to a batch sampler's ``sampler`` (``set_epoch``), never to the batch
        sampler; without this every epoch would replay the first one's plan."""
        return self

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self._plan = None

    def plan(self) -> EpochPlan:
        if self._plan is None:
            self._plan = self.plan_fn(self.epoch)
        return self._plan

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue in ``state["epoch"]`` after its first ``state["batches_consumed"]`` micro-batches (0 if
        absent); later epochs, and an epoch the loop moves on to before iterating this one, start at their
        beginning."""
        self.set_epoch(state["epoch"])
        self.resume_at = (state["epoch"], state.get("batches_consumed", 0))

    def __iter__(self) -> Iterator[list]:
        resume, self.resume_at = self.resume_at, None
        skip = resume[1] if resume is not None and resume[0] == self.epoch else 0
        mine = (mb for step in self.plan() for mb in step.micro_batches[self.rank])
        for position, micro_batch in enumerate(mine):
            if position >= skip:
                yield micro_batch

    def __len__(self) -> int:
        return sum(len(step.micro_batches[self.rank]) for step in self.plan())


class SparsityAwareSampler(PlannedBatchSampler):
    """Sparsity-aware batching for any map-style dataset of documents whose lengths are known.

    Each epoch, documents are shuffled by (seed, epoch), cut into global batches and partitioned into
    ``num_replicas * batching.micro_batches`` micro-batches of equal predicted time under the token capacity
    ``batching.max_tokens`` (``batching.method="first_fit"``: the token-count baseline). Predicted times come
    from ``cost_model.document_costs`` (token counts without one). Every rank builds the sampler with the same
    lengths and settings and iterates its own micro-batches: lists of document indices, where a rank with
    nothing left in a step gets one ``PaddingItem(index)`` (fetch ``dataset[item.index]`` and give it no loss;
    ``PlanItems`` does this for dict samples).

    Lightning wiring: ``Trainer(use_distributed_sampler=False)``, and in ``train_dataloader()`` (after the
    processes started, so the rank is known) ``DataLoader(dataset, batch_sampler=SparsityAwareSampler(...),
    collate_fn=...)``; with gradient accumulation, ``batching.micro_batches`` must equal
    ``accumulate_grad_batches``. Resume: ``state_dict`` also holds the document costs and step overhead the
    current epoch was planned with (``plan_costs``, ``plan_step_overhead``), since the cost model has learned
    since and the rest of the epoch must be the same plan; ``load_state_dict`` replans that epoch from them.

    Args:
        lengths: tokens of each document, by dataset index.
        batching: how documents are packed and balanced (``BatchingConfig``).
        cost_model: the run's cost model, read when an epoch is planned: its document costs, and its measured
            ``step_overhead``, which SAB weighs against balance when it cuts a batch short.
        seed: seed of the per-epoch shuffling.
        num_replicas, rank: ranks and this rank (default: from ``torch.distributed``).
        context_parallel_size: ranks per context-parallel group (dividing ``num_replicas``); the plan is made
            for the groups and handed to their ranks by ``group_plan``.
    """

    def __init__(
        self,
        lengths,
        batching: BatchingConfig,
        *,
        cost_model: CostModel | None = None,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        context_parallel_size: int = 1,
    ) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batching, self.cost_model, self.seed = batching, cost_model, seed
        self.num_replicas = world_size() if num_replicas is None else num_replicas
        rank = process_rank() if rank is None else rank
        if not 0 <= rank < self.num_replicas:
            raise ConfigError(f"rank={rank} must lie in [0, num_replicas={self.num_replicas})")
        if context_parallel_size < 1 or self.num_replicas % context_parallel_size:
            raise ConfigError(
                f"context_parallel_size={context_parallel_size} must divide num_replicas={self.num_replicas}"
            )
        self.group_size = context_parallel_size
        self.plan_costs: tuple[int, np.ndarray] | None = None  # (epoch, per-document costs it was planned with)
        self.plan_step_overhead = 0.0  # the step overhead that epoch was planned with
        self.planned_efficiency: dict[int, float] = {}
        self.restored: dict[int, tuple[np.ndarray, float | None]] = {}  # epoch: (costs, overhead) to plan it with
        super().__init__(self._plan_epoch, rank=rank)

    def state_dict(self) -> dict:
        """The epoch, and the document costs and step overhead its plan was made with (planned now if not yet)."""
        self.plan()
        _, costs = self.plan_costs
        return {**super().state_dict(), "plan_costs": costs.tolist(), "plan_step_overhead": self.plan_step_overhead}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Also plan ``state["epoch"]`` with the costs and step overhead it was planned with, where the state
        holds them (the overhead is absent from states saved before it was planned with)."""
        super().load_state_dict(state)
        if state.get("plan_costs") is not None:
            overhead = state.get("plan_step_overhead")
            self.restored = {
                state["epoch"]: (np.asarray(state["plan_costs"], dtype=np.float64),
                                 None if overhead is None else float(overhead))
            }
            self._plan = None  # a plan made before the state arrived is not the one to resume

    def document_costs(self) -> np.ndarray:
        """Predicted seconds of each document, summed over the ranks that compute it (token counts without a
        cost model): a document longer than a rank's ``max_tokens`` is shared by a context-parallel group as
        one stream, and each of its ranks pays the ring's communication too."""
        lengths = self.lengths.astype(np.float64)
        if self.cost_model is None:
            return lengths
        costs = self.cost_model.document_costs(lengths)
        shared = lengths > self.batching.max_tokens
        if self.group_size > 1 and shared.any():
            costs[shared] = self.cost_model.group_document_costs(lengths[shared], self.group_size)
        return costs

    def step_overhead(self) -> float:
        return 0.0 if self.cost_model is None else self.cost_model.step_overhead

    def _plan_epoch(self, epoch: int) -> EpochPlan:
        costs, overhead = self.restored.pop(epoch, (None, None))
        costs = self.document_costs() if costs is None else costs
        overhead = self.step_overhead() if overhead is None else overhead
        self.plan_costs, self.plan_step_overhead = (epoch, costs), overhead
        slot, slots = self.batching.for_group(self.group_size), self.num_replicas // self.group_size
        if self.batching.method == "first_fit":
            plan = first_fit_plan(self.lengths, costs, max_tokens=slot.max_tokens, num_ranks=slots, seed=self.seed,
                                  epoch=epoch, shuffle=True)
        else:
            config = PlannerConfig(
                world_size=slots,
                tokens_per_rank=slot.rank_budget,
                capacity=slot.max_tokens,
                micro_batches=slot.micro_batches,
                defer_window=slot.defer_window,
                step_overhead=overhead,
                seed=self.seed,
            )
            # costs depend on length alone; a group's ranks share its slot's work
            cost_of_length = dict(zip(self.lengths.tolist(), (costs / self.group_size).tolist()))
            plan = sparsity_aware_plan(
                self.lengths, lambda ls: np.array([cost_of_length[int(n)] for n in ls]), config, epoch
            )
        plan = group_plan(plan, self.lengths, costs, group_size=self.group_size, rank_tokens=self.batching.max_tokens)
        self.planned_efficiency[epoch] = plan_efficiency(plan)
        return plan
