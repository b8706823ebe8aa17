"""Sparsity-aware batching: the plan of global batches and per-rank micro-batches for one epoch.

Every rank computes the same plan from (seed, epoch, document lengths, costs) without talking: documents
are permuted by (seed, epoch), global batches are cut from the stream by a token budget, and each global
batch is split into ``world_size * micro_batches`` micro-batches of at most ``capacity`` tokens that
minimise the largest predicted time (``partition``).

Within one step, balance is capped by the costliest document. With ``defer_window = k > 0`` an outlier
(a segment whose micro-batch is bound to cost more than a typical one over ``defer_target``) waits in a
queue for at most k steps and is released with other outliers of similar cost once together they balance
a step (or at its deadline); the last steps of the epoch flush the queue, so every document is still used
exactly once per epoch. A global batch with fewer segments than micro-batches (only possible at the end
of an epoch) leaves some micro-batches empty.

The plan from a ``PlanState`` is a pure function of (lengths, costs, config, state), so a resumed run
restarts exactly at the next unconsumed global batch: save the ``state`` of the last consumed batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from sparsebalance_pl.balance import balance_efficiency as balance_efficiency_of_rows
from sparsebalance_pl.errors import ConfigError, DataError

from .partition import CapacityError, partition

#: Maps document lengths (tokens, float array) to predicted seconds per document.
CostFn = Callable[[np.ndarray], np.ndarray]


class Segment(NamedTuple):
    """Tokens ``[start, stop)`` of document ``doc``: a whole document unless it was split for capacity."""

    doc: int
    start: int
    stop: int


@dataclass(frozen=True)
class PlannerConfig:
    """How global batches are cut and split.

    Attributes:
        world_size: data-parallel ranks.
        tokens_per_rank: tokens per micro-batch in the budget; a global batch holds at most
            ``world_size * micro_batches * tokens_per_rank`` tokens.
        capacity: most tokens in one micro-batch (memory); defaults to ``tokens_per_rank``.
        micro_batches: micro-batches per rank and step (gradient accumulation), the same on every rank.
        defer_window: k, the most steps a document may wait after being drawn; 0 disables deferral.
        defer_target: outliers are segments bound to cost more than a typical micro-batch divided by this;
            waiting outliers are released as a group once the step's predicted balance reaches it.
        oversize: a document longer than ``capacity`` is an ``"error"`` or is ``"split"`` into pieces.
        seed: with the epoch, seeds the permutation.
        shuffle: permute the documents each epoch (else keep dataset order).
    """

    world_size: int
    tokens_per_rank: int
    capacity: int | None = None
    micro_batches: int = 1
    defer_window: int = 0
    defer_target: float = 0.95
    oversize: Literal["error", "split"] = "error"
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        for name in ("world_size", "tokens_per_rank", "micro_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        if self.capacity is not None and self.capacity < self.tokens_per_rank:
            raise ConfigError(f"capacity={self.capacity} must be at least tokens_per_rank={self.tokens_per_rank}")
        if self.defer_window < 0:
            raise ConfigError(f"defer_window={self.defer_window} must be non-negative")
        if not 0 < self.defer_target <= 1:
            raise ConfigError(f"defer_target={self.defer_target} must lie in (0, 1]")
        if self.oversize not in ("error", "split"):
            raise ConfigError(f"oversize={self.oversize!r} must be 'error' or 'split'")

    @property
    def cap(self) -> int:
        return self.capacity or self.tokens_per_rank

    @property
    def slots(self) -> int:
        """Micro-batches per step over all ranks."""
        return self.world_size * self.micro_batches

    @property
    def budget(self) -> int:
        """Tokens per global batch."""
        return self.slots * self.tokens_per_rank


@dataclass(frozen=True)
class PlanState:
    """Where a plan stands: everything needed, with the inputs, to plan the rest of the epoch.

    ``cursor`` counts segments drawn from the epoch's stream; ``deferred`` holds drawn segments still
    waiting, as (stream position, last step they may be used in).
    """

    epoch: int
    step: int = 0
    cursor: int = 0
    deferred: tuple[tuple[int, int], ...] = ()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "cursor": self.cursor, "deferred": [list(d) for d in self.deferred]}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> PlanState:
        deferred = tuple((int(p), int(d)) for p, d in state["deferred"])
        return cls(int(state["epoch"]), int(state["step"]), int(state["cursor"]), deferred)


@dataclass(frozen=True)
class GlobalBatch:
    """One step's plan: ``micro_batches[rank][micro]`` segments, with predicted costs and tokens [micro, rank]."""

    index: int
    micro_batches: tuple[tuple[tuple[Segment, ...], ...], ...]
    costs: np.ndarray
    tokens: np.ndarray
    state: PlanState

    @property
    def imbalance(self) -> float:
        """Predicted step time over its balanced time: sum over micro-batches of max / mean over ranks."""
        return 1.0 / balance_efficiency_of_rows(self.costs)


def balance_efficiency(batches: Iterable[GlobalBatch]) -> float:
    """Sum over steps (micro-batch rounds) of the mean rank time over the sum of the slowest (DESIGN.md 6)."""
    return balance_efficiency_of_rows(row for batch in batches for row in batch.costs)


def plan_epoch(
    lengths: Sequence[int] | np.ndarray,
    cost_fn: CostFn,
    config: PlannerConfig,
    epoch: int,
    *,
    state: PlanState | None = None,
) -> Iterator[GlobalBatch]:
    """The global batches of ``epoch`` in order, from its start or from ``state`` (a batch's ``state``).

    ``cost_fn`` is evaluated once per call on all segment lengths; batches after a state depend only on
    (lengths, costs, config, state), so to plan with a refined cost model, call again from the current state.
    """
    state = state or PlanState(epoch)
    if state.epoch != epoch:
        raise ValueError(f"state belongs to epoch {state.epoch}, not {epoch}")
    stream = _Stream.build(lengths, config, epoch)
    cost = np.asarray(cost_fn(stream.length.astype(np.float64)), dtype=np.float64)
    if cost.shape != stream.length.shape or not np.all(np.isfinite(cost)) or np.any(cost < 0):
        raise ValueError("cost_fn must return one finite non-negative cost per length")
    costs = _Costs.build(stream, cost, config)
    while state.cursor < stream.length.size or state.deferred:
        index = state.step
        chosen, parts, state = _Step(stream, costs, config, state).select()
        yield _arrange(stream, cost, config, index, chosen, parts, state)


class _Stream(NamedTuple):
    """The epoch's segments in stream order: permuted documents, oversized ones split into pieces; ``cum``
    counts the tokens before each position."""

    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    cum: np.ndarray

    @classmethod
    def build(cls, lengths: Sequence[int] | np.ndarray, config: PlannerConfig, epoch: int) -> _Stream:
        n = np.asarray(lengths)
        if n.ndim != 1 or (n.size and not np.issubdtype(n.dtype, np.integer)):
            raise DataError(f"document lengths must be a 1-D sequence of integers, got {n.dtype} of shape {n.shape}")
        if n.size and n.min() < 1:
            raise DataError(f"document {int(np.argmin(n))} has length {int(n.min())}: lengths must be integers >= 1")
        order = np.random.default_rng([config.seed, epoch]).permutation(n.size) if config.shuffle else np.arange(n.size)
        ordered = n[order].astype(np.int64)
        too_long = np.flatnonzero(ordered > config.cap)
        if too_long.size and config.oversize == "error":
            doc = int(order[too_long[0]])
            raise DataError(
                f"document {doc} has {int(n[doc])} tokens, more than capacity={config.cap} per micro-batch "
                f"({too_long.size} such documents); raise the capacity or set oversize='split'"
            )
        pieces = -(-ordered // config.cap)
        doc = np.repeat(order, pieces)
        first = np.repeat(np.cumsum(pieces) - pieces, pieces)
        start = (np.arange(doc.size) - first) * config.cap
        length = np.minimum(config.cap, np.repeat(ordered, pieces) - start)
        return cls(doc, start, length, np.concatenate([[0], np.cumsum(length)]))


class _Costs(NamedTuple):
    """Per-segment predicted cost, a lower bound on the cost of the slot holding it, and whether it is an
    outlier that waits for company (only with deferral); ``rate`` is the cost per token of the others."""

    cost: np.ndarray
    bound: np.ndarray
    outlier: np.ndarray
    rate: float

    @classmethod
    def build(cls, stream: _Stream, cost: np.ndarray, config: PlannerConfig) -> _Costs:
        """A slot holds its segment plus the tokens the other slots of a full step cannot take (nearly a
        whole slot when the budget is tight), at the cheapest rate per token. An outlier's bound exceeds
        the typical slot cost (``tokens_per_rank`` at the rate of the non-outliers) times 1 / defer_target;
        the rate and the outliers define each other, so a few fixed-point rounds settle them."""
        tokens = stream.length.astype(np.float64)
        if not tokens.size:
            return cls(cost, cost, np.zeros(0, dtype=bool), 0.0)
        must_hold = max(0, config.budget - (config.slots - 1) * config.cap)
        bound = cost + np.maximum(must_hold - tokens, 0) * (cost / tokens).min()
        outlier = np.zeros(cost.size, dtype=bool)
        rate = cost.sum() / tokens.sum()
        for _ in range(3 if config.defer_window else 0):
            outlier = bound * config.defer_target > config.tokens_per_rank * rate
            rate = cost[~outlier].sum() / max(tokens[~outlier].sum(), 1.0)
        return cls(cost, bound, outlier, float(rate))


class _Step:
    """Chooses the segments of one global batch and the state after it.

    First the waiting outliers to release: all at their deadline, plus the largest group of the costliest
    waiting ones (at most one per slot) whose predicted balance, with the rest of the budget filled at the
    ordinary rate, reaches ``defer_target``. Then draws from the stream fill the budget; an outlier drawn
    joins the queue instead, until k steps later. Finally admitted segments are given back, last first,
    until ``partition`` finds a balanced packing under the capacity. Segments at their deadline always
    fit: the tokens sharing a deadline stay within half the budget, which first-fit-decreasing packs.
    """

    def __init__(self, stream: _Stream, costs: _Costs, config: PlannerConfig, state: PlanState) -> None:
        self.stream, self.costs, self.config, self.state = stream, costs, config, state
        self.queue = dict(state.deferred)
        self.due: set[int] = set()
        self.chosen: list[int] = []
        self.tokens = 0
        self.budget = config.budget
        self.cursor = state.cursor

    def select(self) -> tuple[list[int], list[list[int]], PlanState]:
        """Stream positions of the chosen segments, their partition into slots, and the next state."""
        for p in self._release(flush=self.cursor >= self.stream.length.size):
            if self._fits(p):
                self._admit(p)
        self._draw()
        if not self.chosen:  # the stream ended in outliers that all went to the queue
            for p in self._release(flush=True):
                if self._fits(p):
                    self._admit(p)
        parts = None
        while parts is None:
            parts = self._partition()
        for p in self.chosen:
            self.queue.pop(p, None)
        deferred = tuple(sorted(self.queue.items(), key=lambda item: (item[1], item[0])))
        return self.chosen, parts, PlanState(self.state.epoch, self.state.step + 1, self.cursor, deferred)

    def _release(self, flush: bool) -> list[int]:
        """Waiting segments to use now, those at their deadline (all when flushing) first."""
        step, bound = self.state.step, self.costs.bound
        waiting = sorted(self.queue, key=lambda p: (-bound[p], p))
        self.due = {p for p in waiting if self.queue[p] <= step}
        must = [p for p in waiting if p in self.due or flush]
        floor = max((bound[p] for p in must), default=0.0)
        optional = [p for p in waiting if p not in must]
        for level in [bound[p] for p in optional if bound[p] > floor] + [floor]:
            group = must + [p for p in optional if bound[p] <= level][: max(0, self.config.slots - len(must))]
            if level == floor or self._predicted_balance(group, level) >= self.config.defer_target:
                return group
        return must

    def _predicted_balance(self, group: list[int], level: float) -> float:
        tokens = int(self.stream.length[group].sum())
        if tokens > self.budget:
            return 0.0
        mean = (self.costs.cost[group].sum() + (self.budget - tokens) * self.costs.rate) / self.config.slots
        return float(mean / max(mean, level))

    def _fits(self, p: int) -> bool:
        return self.tokens + int(self.stream.length[p]) <= self.budget

    def _admit(self, p: int) -> None:
        self.chosen.append(p)
        self.tokens += int(self.stream.length[p])

    def _draw(self) -> None:
        """Admit stream segments while they fit; outliers go to the queue while their deadline has room."""
        deadline = self.state.step + self.config.defer_window
        while self.cursor < self.stream.length.size:
            p = self.cursor
            if self.costs.outlier[p] and self._can_wait(p):
                self.queue[p] = deadline
            elif self._fits(p):
                self._admit(p)
            else:
                return
            self.cursor += 1

    def _can_wait(self, p: int) -> bool:
        """Whether p may wait: not at its deadline and, if not queued yet, its deadline group keeps room."""
        if p in self.due:
            return False
        if p in self.queue:
            return True
        deadline = self.state.step + self.config.defer_window
        waiting = sum(int(self.stream.length[q]) for q, d in self.queue.items() if d == deadline)
        return 2 * (waiting + int(self.stream.length[p])) <= self.config.budget

    def _partition(self) -> list[list[int]] | None:
        """The slots of the admitted segments, or None after giving one back when the balanced packing fails.

        A segment given back lowers the step's budget to what is left, so it cannot be re-admitted.
        """
        args = (self.costs.cost[self.chosen], self.config.slots)
        kwargs = {"tokens": self.stream.length[self.chosen], "capacity": self.config.cap}
        try:
            return partition(*args, **kwargs, token_fallback=False)
        except CapacityError:
            if self._give_back():
                self.budget = self.tokens
                return None
        return partition(*args, **kwargs)

    def _give_back(self) -> bool:
        """Return the last admitted segment that may leave to the stream or the queue; False if none may."""
        for p in reversed(self.chosen):
            if p == self.cursor - 1 and p >= self.state.cursor:
                self.cursor -= 1
            elif self.config.defer_window and self._can_wait(p):
                self.queue.setdefault(p, self.state.step + self.config.defer_window)
            else:
                continue
            self.chosen.remove(p)
            self.tokens -= int(self.stream.length[p])
            return True
        return False


def _arrange(
    stream: _Stream,
    costs: np.ndarray,
    config: PlannerConfig,
    index: int,
    chosen: list[int],
    parts: list[list[int]],
    state: PlanState,
) -> GlobalBatch:
    """Lay the slots out as [micro, rank]: costliest slots in the first micro-batch, snake order over ranks.

    Each micro-batch index then holds slots of similar cost (ranks synchronise per micro-batch under FSDP),
    and alternating the direction evens out the per-rank sums.
    """
    positions = [np.sort(np.asarray(chosen, dtype=np.int64)[part]) for part in parts]
    slot_cost = np.array([costs[p].sum() for p in positions])
    slot_tokens = np.array([stream.length[p].sum() for p in positions], dtype=np.int64)
    grid = np.argsort(-slot_cost, kind="stable").reshape(config.micro_batches, config.world_size)
    grid[1::2] = grid[1::2, ::-1]
    micro_batches = tuple(
        tuple(
            tuple(Segment(int(stream.doc[p]), int(stream.start[p]), int(stream.start[p] + stream.length[p])) for p in positions[slot])
            for slot in grid[:, rank]
        )
        for rank in range(config.world_size)
    )
    return GlobalBatch(index, micro_batches, slot_cost[grid], slot_tokens[grid], state)
