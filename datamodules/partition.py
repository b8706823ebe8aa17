"""Split one global batch of documents over ranks so that the slowest rank is as fast as possible.

Every rank waits for the slowest at each collective, so the objective is the largest summed cost, under a
per-rank token capacity (memory). ``partition`` starts from the longest-processing-time greedy (largest
cost first, onto the lightest rank with room) and improves it by a local search of moves, swaps and
trades (one document for several cheaper per token, which balances against ranks full of cheap ones) out
of the heaviest rank; on small batches it also refines Karmarkar-Karp's packing, when that fits the
capacity, and keeps the lighter of the two. The result is deterministic (ties go to the lower index), which
lets every rank compute the same plan without talking. ``karmarkar_karp`` is the cost-only baseline the
benchmarks compare with.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

ArrayLike = Sequence[float] | np.ndarray

#: Swap and trade candidates are the documents of the lightest ranks, at most this many, which bounds one
#: local-search round to some ten thousand pair evaluations on large batches.
_SWAP_POOL = 512
#: Resolution of the local search, as a fraction of the lower bound max(mean load, costliest document): it
#: stops within this of the bound and takes no step that gains less (far below step-time noise).
_RESOLUTION = 1e-4
#: Most candidate evaluations (document pairs and document-rank pairs) of one local search, about 10 ms of
#: numpy: a batch of 8,192 documents over 64 ranks reaches it, one of a thousand over 32 ranks rarely.
_SEARCH_WORK = 1_000_000


#: On batches up to this many documents times ranks (about 3 ms of pure Python), ``partition`` also refines
#: Karmarkar-Karp's packing when it fits the capacity and keeps the better: differencing escapes some
#: local optima of the greedy start on small batches, where one document moves the maximum most.
_DIFFERENCING_WORK = 4096


class CapacityError(ValueError):
    """The documents cannot be placed on the ranks without exceeding the token capacity."""


def partition(
    costs: ArrayLike,
    num_ranks: int,
    *,
    tokens: ArrayLike | None = None,
    capacity: int | None = None,
    token_fallback: bool = True,
    start: Sequence[int] | np.ndarray | None = None,
) -> list[list[int]]:
    """Indices of the documents on each rank, minimising the largest summed cost over ranks.

    With ``tokens`` and ``capacity`` no rank holds more than ``capacity`` tokens. Raises ``CapacityError``
    (a ``ValueError``) naming the numbers when that is impossible (one document above the capacity, more
    tokens than ``num_ranks * capacity``) or when no packing was found. Indices are ascending per rank.

    When the cost-ordered greedy leaves a document without room (a nearly full batch), the packing falls
    back to first-fit-decreasing by tokens, rebalanced by the local search; ``token_fallback=False``
    raises ``CapacityError`` instead, so a caller that can drop a document gets a better balance.

    ``start`` (a rank per document, within the capacity) replaces the greedy start: a caller that changed
    a few documents of a balanced packing improves on it instead of packing again.
    """
    cost_n, token_n, cap = _validated(costs, num_ranks, tokens, capacity)
    if start is None:
        rank_n = _packed(cost_n, token_n, cap, num_ranks, token_fallback)
    else:
        rank_n = _validated_start(start, token_n, cap, num_ranks)
    _refine(cost_n, token_n, cap, rank_n, num_ranks)
    return [np.flatnonzero(rank_n == r).tolist() for r in range(num_ranks)]


def _packed(cost_n: np.ndarray, token_n: np.ndarray, cap: float, num_ranks: int, token_fallback: bool) -> np.ndarray:
    """A rank per document within the capacity: the greedy packing (or Karmarkar-Karp's, refined, when it is
    the lighter), documents it left without room fitted in, else first-fit-decreasing by tokens."""
    rank_n = _greedy(cost_n, token_n, cap, num_ranks)
    if cost_n.size * num_ranks <= _DIFFERENCING_WORK and np.all(rank_n >= 0):
        differencing = _differencing_start(cost_n, token_n, cap, num_ranks)
        if differencing is not None:
            rank_n = _lighter_after_refining([rank_n, differencing], cost_n, token_n, cap, num_ranks)
    if not _place_leftovers(cost_n, token_n, cap, rank_n, num_ranks):
        if not token_fallback:
            unplaced = int(np.flatnonzero(rank_n < 0)[0])
            raise CapacityError(
                f"the cost-balanced packing left document {unplaced} ({int(token_n[unplaced])} tokens) without "
                f"room on {num_ranks} ranks of {int(cap)} tokens ({int(token_n.sum())} tokens in all)"
            )
        rank_n = _first_fit_decreasing(token_n, cap, num_ranks)
    return rank_n


def karmarkar_karp(costs: ArrayLike, num_ranks: int) -> list[list[int]]:
    """The largest differencing method for ``num_ranks`` ways, without capacity (as in verl).

    Each document starts as a partial partition with its cost on one rank; the two partial partitions with
    the largest spread are merged, heaviest rank of one with lightest of the other, until one remains.
    """
    cost_n, _, _ = _validated(costs, num_ranks, None, None)
    heap: list[tuple[float, int, list[float], list[list[int]]]] = []
    for i, c in enumerate(cost_n.tolist()):
        sums = [c] + [0.0] * (num_ranks - 1)
        heap.append((-c, i, sums, [[i]] + [[] for _ in range(num_ranks - 1)]))
    heapq.heapify(heap)
    while len(heap) > 1:
        _, key, sums_a, groups_a = heapq.heappop(heap)
        _, _, sums_b, groups_b = heapq.heappop(heap)
        # Both are kept sorted by decreasing sum: pair a's heaviest with b's lightest.
        merged = sorted(
            ((sums_a[r] + sums_b[-1 - r], groups_a[r] + groups_b[-1 - r]) for r in range(num_ranks)),
            key=lambda pair: -pair[0],
        )
        sums = [s for s, _ in merged]
        heapq.heappush(heap, (sums[-1] - sums[0], key, sums, [g for _, g in merged]))
    groups = heap[0][3] if heap else [[] for _ in range(num_ranks)]
    return [sorted(g) for g in groups]


def _validated(
    costs: ArrayLike, num_ranks: int, tokens: ArrayLike | None, capacity: int | None
) -> tuple[np.ndarray, np.ndarray, float]:
    """Costs and tokens as float arrays and the capacity (inf when unbounded), or a ValueError saying why."""
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive integer, got {num_ranks!r}")
    cost_n = np.asarray(costs, dtype=np.float64)
    if cost_n.ndim != 1 or not np.all(np.isfinite(cost_n)) or np.any(cost_n < 0):
        raise ValueError("costs must be a 1-D sequence of finite non-negative numbers")
    if capacity is not None and tokens is None:
        raise ValueError("capacity needs tokens: pass the token count of every document")
    if tokens is None:
        return cost_n, np.zeros_like(cost_n), np.inf
    token_n = np.asarray(tokens, dtype=np.float64)
    if token_n.shape != cost_n.shape:
        raise ValueError(f"tokens has shape {token_n.shape}, costs {cost_n.shape}: one token count per document")
    if not np.all(np.isfinite(token_n)) or np.any(token_n < 0) or np.any(token_n != np.round(token_n)):
        raise ValueError("tokens must be non-negative integers")
    if capacity is None:
        return cost_n, token_n, np.inf
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    if token_n.size and token_n.max() > capacity:
        i = int(np.argmax(token_n))
        raise CapacityError(f"document {i} has {int(token_n[i])} tokens, more than the capacity of {capacity} per rank")
    if token_n.sum() > num_ranks * capacity:
        raise CapacityError(
            f"{int(token_n.sum())} tokens do not fit on {num_ranks} ranks of {capacity} tokens "
            f"({num_ranks * capacity} in all)"
        )
    return cost_n, token_n, float(capacity)


def _differencing_start(cost_n: np.ndarray, token_n: np.ndarray, cap: float, num_ranks: int) -> np.ndarray | None:
    """Karmarkar-Karp's packing as a rank per document, or None when it breaks the capacity."""
    rank_n = np.empty(cost_n.size, dtype=np.int64)
    for r, part in enumerate(karmarkar_karp(cost_n, num_ranks)):
        rank_n[part] = r
    fits = np.bincount(rank_n, weights=token_n, minlength=num_ranks).max(initial=0.0) <= cap
    return rank_n if fits else None


def _lighter_after_refining(
    starts: list[np.ndarray], cost_n: np.ndarray, token_n: np.ndarray, cap: float, num_ranks: int
) -> np.ndarray:
    """Each complete packing refined in place; the one with the lightest heaviest rank (the first on ties)."""
    for rank_n in starts:
        _refine(cost_n, token_n, cap, rank_n, num_ranks)
    return min(starts, key=lambda rank_n: np.bincount(rank_n, weights=cost_n, minlength=num_ranks).max())


def _validated_start(start: Sequence[int] | np.ndarray, token_n: np.ndarray, cap: float, num_ranks: int) -> np.ndarray:
    """``start`` as a fresh int array, or a ValueError when it is no packing of these documents."""
    rank_n = np.array(start, dtype=np.int64)
    if rank_n.shape != token_n.shape or (rank_n.size and (rank_n.min() < 0 or rank_n.max() >= num_ranks)):
        raise ValueError(f"start must give each of the {token_n.size} documents a rank in [0, {num_ranks})")
    if np.bincount(rank_n, weights=token_n, minlength=num_ranks).max(initial=0.0) > cap:
        raise ValueError(f"start puts more than the capacity of {int(cap)} tokens on a rank")
    return rank_n


def _greedy(cost_n: np.ndarray, token_n: np.ndarray, cap: float, num_ranks: int) -> np.ndarray:
    """Largest cost first onto the lightest rank with room; -1 for documents that found no room.

    Ranks sit in a heap by load; a rank without room for the current document is parked in a heap by room
    and comes back once a document small enough arrives, so a nearly full batch stays O(n log ranks).
    """
    rank_n = np.full(cost_n.size, -1, dtype=np.int64)
    load, room = [0.0] * num_ranks, [cap] * num_ranks
    heap = [(0.0, r) for r in range(num_ranks)]
    parked: list[tuple[float, int]] = []
    costs, tokens = cost_n.tolist(), token_n.tolist()
    for i in np.argsort(-cost_n, kind="stable").tolist():
        while parked and -parked[0][0] >= tokens[i]:
            r = heapq.heappop(parked)[1]
            heapq.heappush(heap, (load[r], r))
        while heap and room[heap[0][1]] < tokens[i]:
            r = heapq.heappop(heap)[1]
            heapq.heappush(parked, (-room[r], r))
        if not heap:
            continue
        r = heap[0][1]
        rank_n[i] = r
        room[r] -= tokens[i]
        load[r] += costs[i]
        heapq.heapreplace(heap, (load[r], r))
    return rank_n


def _place_leftovers(cost_n: np.ndarray, token_n: np.ndarray, cap: float, rank_n: np.ndarray, num_ranks: int) -> bool:
    """Fit each unplaced document d by relocating one smaller document b: b moves from rank j to a rank k
    with room for it, d takes its place on j. Picks the relocation with the smallest resulting max load of
    j and k. In place; False when some document still has no room (fragmentation beyond one relocation)."""
    load = np.bincount(rank_n[rank_n >= 0], weights=cost_n[rank_n >= 0], minlength=num_ranks)
    room = cap - np.bincount(rank_n[rank_n >= 0], weights=token_n[rank_n >= 0], minlength=num_ranks)
    for d in np.flatnonzero(rank_n < 0).tolist():
        placed = np.flatnonzero(rank_n >= 0)
        j = rank_n[placed]
        # Rank k must take b: [candidates b, ranks k].
        fits_k = (room[None, :] >= token_n[placed][:, None]) & (np.arange(num_ranks)[None, :] != j[:, None])
        fits_j = room[j] + token_n[placed] >= token_n[d]
        after = np.maximum(load[j][:, None] - cost_n[placed][:, None] + cost_n[d], load[None, :] + cost_n[placed][:, None])
        after[~(fits_k & fits_j[:, None])] = np.inf
        best = int(np.argmin(after))
        if not np.isfinite(after.flat[best]):
            return False
        b_index, k = divmod(best, num_ranks)
        b, j_b = placed[b_index], int(j[b_index])
        rank_n[b], rank_n[d] = k, j_b
        load[k] += cost_n[b]
        room[k] -= token_n[b]
        load[j_b] += cost_n[d] - cost_n[b]
        room[j_b] += token_n[b] - token_n[d]
    return True


def _first_fit_decreasing(token_n: np.ndarray, cap: float, num_ranks: int) -> np.ndarray:
    """Most tokens first onto the first rank with room: packs whatever fits in half the total capacity."""
    rank_n = np.empty(token_n.size, dtype=np.int64)
    room = np.full(num_ranks, cap)
    for i in np.argsort(-token_n, kind="stable").tolist():
        fits = np.flatnonzero(room >= token_n[i])
        if fits.size == 0:
            raise CapacityError(
                f"found no packing of {token_n.size} documents ({int(token_n.sum())} tokens) on {num_ranks} ranks "
                f"of {int(cap)} tokens: document {i} ({int(token_n[i])} tokens) fits nowhere, largest room left "
                f"{int(room.max())}; use fewer tokens per global batch"
            )
        rank_n[i] = fits[0]
        room[fits[0]] -= token_n[i]
    return rank_n


def _refine(cost_n: np.ndarray, token_n: np.ndarray, cap: float, rank_n: np.ndarray, num_ranks: int) -> None:
    """Local search in place: the best move, swap or trade out of the heaviest rank, until none lowers it.

    Each candidate changes the heaviest rank m and one other rank j; it is taken only if the larger of
    their new loads is below m's load by a resolution step and both stay within capacity, so the sorted
    loads fall and the search ends. Swaps and trades look at the lightest ranks only (``_SWAP_POOL``), and
    the search stops after ``_SEARCH_WORK`` candidate evaluations (large, nearly full batches improve by
    many small steps).
    """
    if num_ranks < 2 or cost_n.size < 2:
        return
    load = np.bincount(rank_n, weights=cost_n, minlength=num_ranks)
    used = np.bincount(rank_n, weights=token_n, minlength=num_ranks)
    per_rank = max(1, cost_n.size // num_ranks)
    pool = min(num_ranks - 1, max(1, _SWAP_POOL // per_rank))
    bound = max(cost_n.sum() / num_ranks, cost_n.max())
    step = _RESOLUTION * bound
    # Cheapest per token first: a trade hands m the most tokens for the cost it takes.
    by_rate = np.argsort(cost_n / np.maximum(token_n, 1.0), kind="stable")
    state = _Loads(cost_n, token_n, cap, rank_n, load, used)
    neighbourhoods = [_best_move, _best_swap] + ([_best_trade] if np.isfinite(cap) else [])
    in_pool = np.zeros(num_ranks, dtype=bool)
    work = 0
    while work < _SEARCH_WORK:
        m = int(np.argmax(load))
        if load[m] <= bound + step:
            return
        mine = np.flatnonzero(rank_n == m)
        light = np.argsort(load, kind="stable")
        in_pool[:] = False
        in_pool[light[light != m][:pool]] = True
        theirs = by_rate[in_pool[rank_n[by_rate]]]
        theirs = theirs[np.argsort(rank_n[theirs], kind="stable")][:_SWAP_POOL]
        candidates = [find(state, m, mine, theirs) for find in neighbourhoods]
        work += mine.size * (num_ranks + theirs.size)
        value, changes = min(candidates, key=lambda candidate: candidate[0])
        if value >= load[m] - step:
            return
        for doc, src, dst in changes:
            rank_n[doc] = dst
            load[src] -= cost_n[doc]
            load[dst] += cost_n[doc]
            used[src] -= token_n[doc]
            used[dst] += token_n[doc]


class _Loads(NamedTuple):
    """What the local search works on; ``rank_n``, ``load`` and ``used`` change in place."""

    cost: np.ndarray
    tokens: np.ndarray
    cap: float
    rank_n: np.ndarray
    load: np.ndarray
    used: np.ndarray


#: The larger new load of the two ranks a candidate changes, and its changes as (document, from, to).
_Candidate = tuple[float, list[tuple[int, int, int]]]


def _best_move(s: _Loads, m: int, mine: np.ndarray, theirs: np.ndarray) -> _Candidate:
    """One document of m onto any rank with room for it."""
    c_a, t_a = s.cost[mine][:, None], s.tokens[mine][:, None]
    after = np.maximum(s.load[m] - c_a, s.load[None, :] + c_a)  # [docs of m, ranks]
    after[(s.used[None, :] + t_a > s.cap) | (np.arange(s.load.size) == m)[None, :]] = np.inf
    best = int(np.argmin(after))
    a, j = divmod(best, s.load.size)
    return float(after.flat[best]), [(int(mine[a]), m, j)]


def _best_swap(s: _Loads, m: int, mine: np.ndarray, theirs: np.ndarray) -> _Candidate:
    """A document of m for a cheaper one of a light rank (``theirs``: the light ranks' documents)."""
    if not theirs.size:
        return np.inf, []
    c_a, t_a = s.cost[mine][:, None], s.tokens[mine][:, None]
    j_b, t_b = s.rank_n[theirs][None, :], s.tokens[theirs][None, :]
    delta = c_a - s.cost[theirs][None, :]  # [docs of m, their docs]
    after = np.maximum(s.load[m] - delta, s.load[j_b] + delta)
    after[(delta <= 0) | (s.used[m] - t_a + t_b > s.cap) | (s.used[j_b] - t_b + t_a > s.cap)] = np.inf
    best = int(np.argmin(after))
    a, b = divmod(best, theirs.size)
    j = int(s.rank_n[theirs[b]])
    return float(after.flat[best]), [(int(mine[a]), m, j), (int(theirs[b]), j, m)]


def _best_trade(s: _Loads, m: int, mine: np.ndarray, theirs: np.ndarray) -> _Candidate:
    """A document a of m for the cheapest-per-token documents of a light rank j, as many as bring the two
    loads closest: m takes more tokens for less cost, the way to balance against a rank full of cheap ones.
    ``theirs`` lists the light ranks' documents by rank, cheapest per token first within each."""
    if not theirs.size:
        return np.inf, []
    ranks, first = np.unique(s.rank_n[theirs], return_index=True)
    stop = np.r_[first[1:], theirs.size]
    paid = np.r_[0.0, np.cumsum(s.cost[theirs])]  # paid[first[j] + k] - paid[first[j]]: j's first k documents
    sent = np.r_[0.0, np.cumsum(s.tokens[theirs])]
    c_a, t_a = s.cost[mine][:, None], s.tokens[mine][:, None]
    load_j, used_j = s.load[ranks][None, :], s.used[ranks][None, :]
    # The tokens m may take and j must give bound the number of documents taken from j to [low, high].
    low = np.maximum(np.searchsorted(sent, sent[first] + used_j + t_a - s.cap), first)
    high = np.minimum(np.searchsorted(sent, sent[first] + s.cap - s.used[m] + t_a, side="right") - 1, stop)
    # The two new loads meet when j's documents cost this; the best end is next to it (loads are monotone).
    wanted = c_a - (s.load[m] - load_j) / 2  # [docs of m, light ranks]
    hit = np.searchsorted(paid, paid[first][None, :] + wanted)
    best_value, best_changes = np.inf, []
    for end in (hit - 1, hit):
        end = np.clip(np.minimum(np.maximum(end, low), high), first, stop)
        cost_k = paid[end] - paid[first][None, :]
        after = np.maximum(s.load[m] - c_a + cost_k, load_j + c_a - cost_k)
        after[high < low] = np.inf
        best = int(np.argmin(after))
        if after.flat[best] < best_value:
            a, j = divmod(best, ranks.size)
            given = theirs[first[j] : end.flat[best]].tolist()
            best_value = float(after.flat[best])
            best_changes = [(int(mine[a]), m, int(ranks[j]))] + [(b, int(ranks[j]), m) for b in given]
    return best_value, best_changes
