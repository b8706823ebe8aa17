"""Sparsity-aware batching: the plan of global batches and per-rank micro-batches for one epoch.

Every rank computes the same plan from (seed, epoch, document lengths, costs) without talking: documents
are permuted by (seed, epoch), global batches are cut from the stream by a token budget, and each global
batch is split into ``world_size * micro_batches`` micro-batches of at most ``capacity`` tokens that
minimise the largest predicted time (``partition``). A full batch can be impossible to balance under the
capacity (slots full of cheap segments cannot take on more cost, and a costly segment's slot should hold
little else), so the budget leaves out the room such slots cannot use and the last segments go back to
the stream when that improves the balance: the next step takes them at less cost in time than the
imbalance they would cause.

Within one step, balance is capped by the costliest document. With ``defer_window = k > 0`` an outlier
(a segment whose micro-batch is bound to cost more than a typical full one) waits in a queue for at most
k steps and is released with other outliers of similar cost once together they balance a step (or at its
deadline). Once what is left of the epoch fits in two global batches, the two are planned together, the
waiting outliers with ordinary segments that balance them, so every document is still used exactly once
per epoch and the queue never ends in a step of its own. A global batch with fewer segments than
micro-batches (only possible at the end of an epoch) leaves some micro-batches empty.

The plan is a pure function of (lengths, costs, config, epoch): a resumed run plans the epoch again with the
costs it was first planned with and skips the micro-batches it has consumed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from sparsebalance_pl.balance import imbalance
from sparsebalance_pl.errors import ConfigError, DataError

from .partition import CapacityError, partition

#: A step within this fraction of its lower bound max(mean slot cost, costliest segment) is balanced.
_BALANCE_TOLERANCE = 1e-3

#: The last steps of an epoch with deferral are planned together once what is left fits in this many.
_TAIL_STEPS = 2

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
        defer_target: the predicted balance at which a group of waiting outliers is released at the latest
            (as the group's earliest deadline comes); outliers just drawn wait for a perfect group.
        oversize: a document longer than ``capacity`` is an ``"error"`` or is ``"split"`` into pieces.
        step_overhead: predicted seconds each step costs beyond its micro-batches (the optimiser, collectives
            that compute does not hide), in the unit of the costs: a batch is cut short to balance only when
            what it saves exceeds the share of an extra step's overhead the tokens it gives back will cost.
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
    step_overhead: float = 0.0
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
        if not self.step_overhead >= 0:
            raise ConfigError(f"step_overhead={self.step_overhead} must be non-negative")
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
class _Progress:
    """Where the plan of an epoch stands after a step: ``cursor`` counts segments drawn from the epoch's
    stream; ``deferred`` holds drawn segments still waiting, as (stream position, last step they may be used in).
    """

    step: int = 0
    cursor: int = 0
    deferred: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class GlobalBatch:
    """One step's plan: ``micro_batches[rank][micro]`` segments, with predicted costs and tokens [micro, rank];
    ``deferred``: the drawn segments still waiting after it, as (stream position, last step they may be used in)."""

    index: int
    micro_batches: tuple[tuple[tuple[Segment, ...], ...], ...]
    costs: np.ndarray
    tokens: np.ndarray
    deferred: tuple[tuple[int, int], ...]

    @property
    def imbalance(self) -> float:
        """Predicted step time over its balanced time: sum over micro-batches of max / mean over ranks."""
        return imbalance(self.costs)


def plan_epoch(
    lengths: Sequence[int] | np.ndarray,
    cost_fn: CostFn,
    config: PlannerConfig,
    epoch: int,
) -> Iterator[GlobalBatch]:
    """The global batches of ``epoch`` in order; ``cost_fn`` is evaluated once, on all segment lengths."""
    state = _Progress()
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
    """Per-segment predicted cost, a lower bound on the cost of the slot holding it, the positions of the
    outliers (which wait for company when deferral is on), and ``rate``, the cost per token of the others."""

    cost: np.ndarray
    bound: np.ndarray
    outliers: np.ndarray
    rate: float

    @classmethod
    def build(cls, stream: _Stream, cost: np.ndarray, config: PlannerConfig) -> _Costs:
        """A slot holds its segment plus the tokens the other slots of a full step cannot take (nearly a
        whole slot when the budget is tight), at the cheapest rate per token. An outlier's bound exceeds
        the typical slot cost (``tokens_per_rank`` at the rate of the non-outliers): in an ordinary step it
        would be the slowest slot. The rate and the outliers define each other, so a few fixed-point
        rounds settle them."""
        tokens = stream.length.astype(np.float64)
        if not tokens.size:
            return cls(cost, cost, np.zeros(0, dtype=np.int64), 0.0)
        must_hold = max(0, config.budget - (config.slots - 1) * config.cap)
        bound = cost + np.maximum(must_hold - tokens, 0) * (cost / tokens).min()
        outlier = np.zeros(cost.size, dtype=bool)
        rate = cost.sum() / tokens.sum()
        for _ in range(3):
            outlier = bound > config.tokens_per_rank * rate
            rate = cost[~outlier].sum() / max(tokens[~outlier].sum(), 1.0)
        return cls(cost, bound, np.flatnonzero(outlier), float(rate))


class _Step:
    """Chooses the segments of one global batch and the state after it.

    First the waiting outliers to release: all at their deadline, plus the largest group of the costliest
    waiting ones (at most one per slot) whose predicted balance, with the rest of the budget filled at the
    ordinary rate, reaches what the group needs (``_required``). Then draws from the stream fill the
    budget, less the room that admitted outliers' slots cannot use (``_room_lost``); an outlier drawn
    joins the queue instead, for at most k steps. Finally admitted segments are given back, last first,
    until ``partition`` finds a packing under the capacity, and once more if that improves its balance
    (``_rebalance``). Segments at their deadline always fit: the tokens sharing a deadline stay within
    half the budget, which first-fit-decreasing packs.
    """

    def __init__(self, stream: _Stream, costs: _Costs, config: PlannerConfig, state: _Progress) -> None:
        self.stream, self.costs, self.config, self.state = stream, costs, config, state
        self.queue = dict(state.deferred)
        self.due: set[int] = set()
        self.chosen: list[int] = []
        self.tokens = 0
        self.budget = config.budget
        self.cursor = state.cursor

    def select(self) -> tuple[list[int], list[list[int]], _Progress]:
        """Stream positions of the chosen segments, their partition into slots, and the next state."""
        tail_steps = self._tail_steps()
        if tail_steps:
            return self._select_tail(tail_steps)
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
        parts = self._rebalance(parts)
        for p in self.chosen:
            self.queue.pop(p, None)
        deferred = tuple(sorted(self.queue.items(), key=lambda item: (item[1], item[0])))
        return self.chosen, parts, _Progress(self.state.step + 1, self.cursor, deferred)

    def _tail_steps(self) -> int:
        """The steps the rest of the epoch (stream and queue) needs, once they are few enough to plan
        together (at most ``_TAIL_STEPS``, and only with deferral), else 0."""
        if not self.config.defer_window:
            return 0
        stream = self.stream
        rest = int(stream.cum[-1] - stream.cum[self.cursor]) + int(stream.length[list(self.queue)].sum())
        steps = -(-rest // self.budget)
        return steps if steps <= min(_TAIL_STEPS, self.config.defer_window + 1) else 0

    def _select_tail(self, steps: int) -> tuple[list[int], list[list[int]], _Progress]:
        """Split everything left over the slots of the remaining ``steps`` at once, take the costliest
        ``slots`` slots now, topped up to the slowest of them, and queue the rest for the last step.
        One-step planning would leave the waiting outliers for a last, nearly empty step without the
        ordinary segments that balance them."""
        cost, length, slots = self.costs.cost, self.stream.length, self.config.slots
        left = sorted(self.queue) + list(range(self.cursor, length.size))
        while True:  # a nearly full tail may not pack: plan it over one more step
            try:
                parts = partition(cost[left], steps * slots, tokens=length[left], capacity=self.config.cap)
                break
            except CapacityError:
                steps += 1
        parts.sort(key=lambda part: -cost[[left[i] for i in part]].sum())
        now = [[left[i] for i in part] for part in parts[:slots]]
        later = self._top_up(now, [left[i] for part in parts[slots:] for i in part])
        self.chosen = [p for part in now for p in part]
        offsets = np.cumsum([0] + [len(part) for part in now]).tolist()
        slot_parts = [list(range(a, b)) for a, b in zip(offsets[:-1], offsets[1:])]
        last = self.state.step + steps - 1
        deferred = tuple(sorted((p, last) for p in later))
        return self.chosen, slot_parts, _Progress(self.state.step + 1, length.size, deferred)

    def _top_up(self, now: list[list[int]], later: list[int]) -> list[int]:
        """Move later segments, costliest first, into this step's slots below its slowest one (the
        outliers' level) while they fit; returns the segments still left for later steps."""
        cost, length = self.costs.cost, self.stream.length
        load = np.array([cost[part].sum() for part in now])
        used = np.array([length[part].sum() for part in now])
        level, kept = load.max(), []
        for p in sorted(later, key=lambda p: (-cost[p], p)):
            room = (load + cost[p] <= level) & (used + length[p] <= self.config.cap)
            if not room.any():
                kept.append(p)
                continue
            k = int(np.flatnonzero(room)[np.argmin(load[room])])
            now[k].append(p)
            load[k] += cost[p]
            used[k] += length[p]
        return kept

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
            if level == floor or self._predicted_balance(group, level) >= self._required(group):
                return group
        return must

    def _required(self, group: list[int]) -> float:
        """The predicted balance a group needs to leave the queue: 1 while its members have just arrived,
        falling linearly to ``defer_target`` at the earliest deadline among them. Fresh outliers wait for
        partners of their own cost; old ones take the best group there is."""
        slack = min(self.queue[p] for p in group) - self.state.step
        return 1 - (1 - self.config.defer_target) * max(0.0, 1 - slack / max(self.config.defer_window, 1))

    def _predicted_balance(self, group: list[int], level: float) -> float:
        tokens = int(self.stream.length[group].sum())
        if tokens > self.budget:
            return 0.0
        mean = (self.costs.cost[group].sum() + (self.budget - tokens) * self.costs.rate) / self.config.slots
        return float(mean / max(mean, level))

    def _fits(self, p: int) -> bool:
        """Whether p fits the budget, less the room outliers' slots cannot use (due segments: the budget)."""
        room_lost = 0 if p in self.due else self._room_lost(self.chosen + [p])
        return self.tokens + int(self.stream.length[p]) <= self.budget - room_lost

    def _admit(self, p: int) -> None:
        self.chosen.append(p)
        self.tokens += int(self.stream.length[p])

    def _outliers_among(self, positions: list[int]) -> np.ndarray:
        """The outliers among these stream positions."""
        outliers, positions_n = self.costs.outliers, np.asarray(positions, dtype=np.int64)
        if not outliers.size:
            return positions_n[:0]
        at = np.minimum(np.searchsorted(outliers, positions_n), outliers.size - 1)
        return positions_n[outliers[at] == positions_n]

    def _room_lost(self, chosen: list[int]) -> int:
        """Budget tokens the slots of the outliers among ``chosen`` cannot take without becoming the slowest.

        A slot takes ordinary segments only up to the step's level, the costliest outlier or a typical
        full slot; beyond, the budget would buy imbalance (the costliest outlier's slot best holds it alone).
        """
        big = self._outliers_among(chosen)
        if not big.size or self.costs.rate <= 0:  # free ordinary segments fill any slot
            return 0
        cost, rate, share = self.costs.cost[big], self.costs.rate, self.config.tokens_per_rank
        filler = (max(share * rate, float(cost.max())) - cost) / rate
        return int(np.maximum(share - self.stream.length[big] - filler, 0).sum())

    def _draw(self) -> None:
        """Admit stream segments while they fit; outliers go to the queue while some deadline has room."""
        cum, outliers, size = self.stream.cum, self.costs.outliers, self.stream.length.size
        while self.cursor < size:
            # The ordinary segments before the next outlier, as many as fit, in one go.
            i = int(np.searchsorted(outliers, self.cursor))
            run_end = int(outliers[i]) if i < outliers.size else size
            room = self.budget - self._room_lost(self.chosen) - self.tokens
            fit_end = int(np.searchsorted(cum, cum[self.cursor] + room, side="right")) - 1
            end = max(self.cursor, min(run_end, fit_end))
            self.chosen.extend(range(self.cursor, end))
            self.tokens += int(cum[end] - cum[self.cursor])
            self.cursor = end
            if end == size or end < run_end:
                return
            deadline = self._deadline(end)
            if deadline is not None:
                self.queue[end] = deadline
            elif self._fits(end):
                self._admit(end)
            else:
                return
            self.cursor += 1

    def _deadline(self, p: int) -> int | None:
        """The step p may wait until, or None if it may not wait.

        Queued segments keep theirs; due ones may not wait again. A new one gets the latest step within the
        window whose segments due together stay within half the budget, so they always fit: the pieces of
        a split document, drawn together, spread over several deadlines instead of entering the step.
        """
        if p in self.due:
            return None
        if p in self.queue:
            return self.queue[p]
        due_tokens: Counter[int] = Counter()
        for q, d in self.queue.items():
            due_tokens[d] += int(self.stream.length[q])
        for deadline in range(self.state.step + self.config.defer_window, self.state.step, -1):
            if 2 * (due_tokens[deadline] + int(self.stream.length[p])) <= self.config.budget:
                return deadline
        return None

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
        try:
            return partition(*args, **kwargs)
        except CapacityError:
            self._postpone()
            self.budget = self.tokens
            return None

    def _postpone(self) -> None:
        """Move the last admitted segment to the next step although it may not wait (it is due, or drawn
        before the last): segments due together fit in half the budget, but those of several deadlines (left
        over when a step had no room) and the step's own may not pack into the slots. One step late beats no
        plan; a single segment always packs, so this ends."""
        p = self.chosen.pop()
        self.tokens -= int(self.stream.length[p])
        self.queue[p] = self.state.step + 1

    def _rebalance(self, parts: list[list[int]]) -> list[list[int]]:
        """Give back ordinary tail segments when the capacity holds the step above its bound max(mean,
        costliest), if the step's balance improves and, when that adds a step to the epoch, what the step
        saves exceeds that step's overhead (else keep ``parts``).

        A slot above the bound is full of segments it was forced to take; giving back as many tokens as it
        must shed lets the other slots take them over. The tokens given back cost the later steps less
        time than the imbalance costs this one, unless they make the epoch one step longer and the steps'
        overhead outweighs the saving.
        """
        cost, tokens = self.costs.cost[self.chosen], self.stream.length[self.chosen]
        excess = _excess_tokens(cost, tokens, parts, self.config.slots)
        if excess == 0:
            return parts
        saved = (list(self.chosen), self.tokens, self.cursor, dict(self.queue))
        while self.tokens > saved[1] - excess and self._give_back(outliers=False):
            pass
        slot_of = {saved[0][i]: slot for slot, part in enumerate(parts) for i in part}
        if self.chosen:  # an empty step would "balance" perfectly and never move the plan on
            cost_now, tokens_now = self.costs.cost[self.chosen], self.stream.length[self.chosen]
            trimmed = partition(cost_now, self.config.slots, tokens=tokens_now, capacity=self.config.cap,
                                start=[slot_of[p] for p in self.chosen])
            if self._trim_saves_time(cost, parts, cost_now, trimmed, full_tokens=saved[1]):
                return trimmed
        self.chosen, self.tokens, self.cursor, self.queue = saved
        return parts

    def _trim_saves_time(self, cost: np.ndarray, parts: list[list[int]], cost_now: np.ndarray,
                         trimmed: list[list[int]], full_tokens: int) -> bool:
        """Whether the trimmed step is better balanced and, if the epoch's remaining tokens then need one more
        full budget, the trimmed step plus the later cost of what it gives back (its balanced time over the
        ranks and that step's overhead) is shorter than the full step (which lasts about ``micro_batches``
        times its slowest slot)."""
        if _efficiency(cost_now, trimmed) <= _efficiency(cost, parts):
            return False
        config, stream = self.config, self.stream
        left = int(stream.cum[-1] - stream.cum[self.state.cursor]) + sum(
            int(stream.length[p]) for p, _ in self.state.deferred)
        extra_steps = -(-(left - self.tokens) // self.budget) - -(-(left - full_tokens) // self.budget)
        if config.step_overhead == 0 or extra_steps <= 0:
            return True
        later = (cost.sum() - cost_now.sum()) / config.world_size + config.step_overhead * extra_steps
        slowest = config.micro_batches * max(cost_now[part].sum() for part in trimmed)
        return slowest + later < config.micro_batches * max(cost[part].sum() for part in parts)

    def _give_back(self, outliers: bool = True) -> bool:
        """Return the last admitted segment that may leave to the stream or the queue; False if none may, or
        if it is an outlier and ``outliers`` is false (it would take the step's level with it)."""
        for i in range(len(self.chosen) - 1, -1, -1):
            p = self.chosen[i]
            if not outliers and self._outliers_among([p]).size:
                return False
            if p == self.cursor - 1 and p >= self.state.cursor:
                self.cursor -= 1
            elif (deadline := self._deadline(p)) is not None:
                self.queue[p] = deadline
            else:
                continue
            del self.chosen[i]
            self.tokens -= int(self.stream.length[p])
            return True
        return False




def _efficiency(cost: np.ndarray, parts: list[list[int]]) -> float:
    """Mean over max of the slot costs."""
    return 1.0 / imbalance([cost[part].sum() for part in parts])


def _excess_tokens(cost: np.ndarray, tokens: np.ndarray, parts: list[list[int]], slots: int) -> int:
    """Tokens the slots above the bound max(mean slot cost, costliest segment) must shed to reach it, cheapest
    per token first (0 when every slot is within ``_BALANCE_TOLERANCE`` of it)."""
    bound = max(cost.sum() / slots, cost.max(initial=0.0))
    slack = _BALANCE_TOLERANCE * bound
    excess = 0
    for part in parts:
        over = cost[part].sum() - bound
        if over > slack:
            cheap = np.asarray(part)[np.argsort(cost[part] / tokens[part], kind="stable")]
            shed = int(np.searchsorted(np.cumsum(cost[cheap]), over - slack)) + 1
            excess += int(tokens[cheap[:shed]].sum())
    return excess


def _arrange(
    stream: _Stream,
    costs: np.ndarray,
    config: PlannerConfig,
    index: int,
    chosen: list[int],
    parts: list[list[int]],
    state: _Progress,
) -> GlobalBatch:
    """Lay the slots out as [micro, rank]: costliest slots in the first micro-batch, snake order over ranks.

    Each micro-batch index then holds slots of similar cost (ranks synchronise per micro-batch under FSDP),
    and alternating the direction evens out the per-rank sums.
    """
    chosen_n = np.asarray(chosen, dtype=np.int64)
    positions = [np.sort(chosen_n[part]) for part in parts]
    slot_cost = np.array([costs[p].sum() for p in positions])
    slot_tokens = np.array([stream.length[p].sum() for p in positions], dtype=np.int64)
    grid = np.argsort(-slot_cost, kind="stable").reshape(config.micro_batches, config.world_size)
    grid[1::2] = grid[1::2, ::-1]
    stop = stream.start + stream.length
    segments = [
        tuple(map(Segment, stream.doc[p].tolist(), stream.start[p].tolist(), stop[p].tolist())) for p in positions
    ]
    micro_batches = tuple(tuple(segments[slot] for slot in grid[:, rank]) for rank in range(config.world_size))
    return GlobalBatch(index, micro_batches, slot_cost[grid], slot_tokens[grid], state.deferred)
