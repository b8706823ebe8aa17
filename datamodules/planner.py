"""Sparsity-aware batching: the plan of global batches and per-rank micro-batches for one epoch.

Every rank computes the same plan from (seed, epoch, document lengths, costs) without talking: documents
are permuted by (seed, epoch), global batches are cut from the stream by a token budget, and each global
batch is split into ``world_size * micro_batches`` micro-batches of at most ``capacity`` tokens that
minimise the largest predicted time (``partition``).

Within one step, balance is capped by the costliest document. With ``defer_window = k > 0`` a document
that would make its step slower than ``mean / defer_target`` waits for a later step (at most k steps after
it was drawn), where it can meet other costly documents; the last steps of the epoch flush the queue, so
every document is still used exactly once per epoch.

The plan from a ``PlanState`` is a pure function of (lengths, costs, config, state), so a resumed run
restarts exactly at the next unconsumed global batch: save the ``state`` of the last consumed batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

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
        defer_target: a step whose costliest movable document exceeds its mean micro-batch cost divided by
            this defers that document.
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
        mean = self.costs.mean(axis=1).sum()
        return float(self.costs.max(axis=1).sum() / mean) if mean > 0 else 1.0


def balance_efficiency(batches: Iterable[GlobalBatch]) -> float:
    """Sum over steps of the mean rank time over the sum of the slowest (1.0 is perfect; DESIGN.md 6)."""
    mean = slowest = 0.0
    for batch in batches:
        mean += batch.costs.mean(axis=1).sum()
        slowest += batch.costs.max(axis=1).sum()
    return mean / slowest if slowest > 0 else 1.0


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
    costs = np.asarray(cost_fn(stream.length.astype(np.float64)), dtype=np.float64)
    if costs.shape != stream.length.shape or not np.all(np.isfinite(costs)) or np.any(costs < 0):
        raise ValueError("cost_fn must return one finite non-negative cost per length")
    while state.cursor < stream.length.size or state.deferred:
        index = state.step
        chosen, parts, state = _Step(stream, costs, config, state).select()
        yield _arrange(stream, costs, config, index, chosen, parts, state)


class _Stream(NamedTuple):
    """The epoch's segments in stream order: permuted documents, oversized ones split into pieces."""

    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray

    @classmethod
    def build(cls, lengths: Sequence[int] | np.ndarray, config: PlannerConfig, epoch: int) -> _Stream:
        n = np.asarray(lengths)
        if n.ndim != 1 or not np.issubdtype(n.dtype, np.integer) or (n.size and n.min() < 1):
            bad = np.flatnonzero(n < 1)[:1].tolist() if n.ndim == 1 and n.dtype.kind in "iuf" else []
            raise DataError(f"document lengths must be a 1-D sequence of integers >= 1 (document {bad or '?'})")
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
        return cls(doc, start, np.minimum(config.cap, np.repeat(ordered, pieces) - start))


class _Step:
    """Chooses the segments of one global batch and the state after it.

    Order of admission: segments at their deadline (forced), other waiting segments costliest first (so
    costly ones meet), then new draws from the stream, each while the budget allows. With deferral on, the
    costliest movable segment is deferred while it caps the step below ``defer_target`` and the budget is
    refilled from the stream. Finally admitted segments are given back, last first, until ``partition``
    finds a packing under the capacity. Forced segments always fit: deferral keeps the tokens sharing a
    deadline within half the budget, which any first-fit-decreasing packing accommodates.
    """

    def __init__(self, stream: _Stream, costs: np.ndarray, config: PlannerConfig, state: PlanState) -> None:
        self.stream, self.costs, self.config, self.state = stream, costs, config, state
        self.deadline = dict(state.deferred)
        self.chosen: list[int] = []
        self.forced: set[int] = set()
        self.tokens = 0
        self.cursor = state.cursor

    def select(self) -> tuple[list[int], list[list[int]], PlanState]:
        """Stream positions of the chosen segments, their partition into slots, and the next state."""
        step = self.state.step
        for p in sorted(self.deadline, key=lambda p: (self.deadline[p] > step, -self.costs[p], p)):
            if self._fits(p):
                self._admit(p)
                if self.deadline[p] <= step:
                    self.forced.add(p)
        self._draw()
        if self.config.defer_window and self.state.cursor < self.stream.length.size:
            self._defer_outliers()
        parts = self._pack()
        for p in self.chosen:
            self.deadline.pop(p, None)
        deferred = tuple(sorted(self.deadline.items(), key=lambda item: (item[1], item[0])))
        return self.chosen, parts, PlanState(self.state.epoch, step + 1, self.cursor, deferred)

    def _fits(self, p: int) -> bool:
        return self.tokens + int(self.stream.length[p]) <= self.config.budget

    def _admit(self, p: int) -> None:
        self.chosen.append(p)
        self.tokens += int(self.stream.length[p])

    def _remove(self, p: int) -> None:
        self.chosen.remove(p)
        self.tokens -= int(self.stream.length[p])

    def _draw(self) -> None:
        while self.cursor < self.stream.length.size and self._fits(self.cursor):
            self._admit(self.cursor)
            self.cursor += 1

    def _can_wait(self, p: int) -> bool:
        """Whether p may leave this step: not forced, and (if new) its deadline group keeps room."""
        if p in self.forced:
            return False
        if p in self.deadline:
            return True
        due = self.state.step + self.config.defer_window
        waiting = sum(int(self.stream.length[q]) for q, d in self.deadline.items() if d == due)
        return 2 * (waiting + int(self.stream.length[p])) <= self.config.budget

    def _defer(self, p: int) -> None:
        self._remove(p)
        self.deadline.setdefault(p, self.state.step + self.config.defer_window)

    def _defer_outliers(self) -> None:
        """Defer the segment whose micro-batch is bound to be slowest while it caps the step's balance.

        A segment's micro-batch costs at least the segment plus the tokens the other slots cannot take
        (under a tight budget nearly a full micro-batch) at the cheapest rate per token in the step.
        """
        slots, cap = self.config.slots, self.config.cap
        while self.chosen:
            chosen = np.asarray(self.chosen)
            cost, tokens = self.costs[chosen], self.stream.length[chosen]
            must_hold = max(0, int(tokens.sum()) - (slots - 1) * cap)
            bound = cost + np.maximum(must_hold - tokens, 0) * (cost / tokens).min()
            top = int(np.argmax(bound))
            if bound[top] * self.config.defer_target <= cost.sum() / slots:
                return
            p = int(chosen[top])
            if not self._can_wait(p):
                return
            self._defer(p)
            self._draw()

    def _pack(self) -> list[list[int]]:
        """Give back admitted segments, last first, until partition packs the rest under the capacity."""
        while True:
            try:
                return partition(
                    self.costs[self.chosen],
                    self.config.slots,
                    tokens=self.stream.length[self.chosen],
                    capacity=self.config.cap,
                )
            except CapacityError:
                self._give_back()

    def _give_back(self) -> None:
        for p in reversed(self.chosen):
            if p == self.cursor - 1 and p >= self.state.cursor:
                self._remove(p)
                self.cursor -= 1
                return
            if self.config.defer_window and self._can_wait(p):
                self._defer(p)
                return
        raise CapacityError(f"step {self.state.step}: no packing found even for the segments that must be used")


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
