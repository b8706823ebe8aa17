"""``select_blocks``: XAttention-style block selection with top-p over the estimated attention mass.

Scoring: within each stride-S group the antidiagonal of the S x S tile of q.k products is summed (a
matmul over stride-reshaped q and reversed k, 1/S of the dense QK^T cost); a softmax over those
stride-level scores, summed per B x B block and normalised per query block, estimates each block's share
of the row's attention mass. On packed streams the stride-level softmax only sees causal groups that share
a document with the query group, so the estimate never spreads mass across documents.

Selection per (query head, query block): the candidates are the causal key blocks sharing a document with
the query block (a block holding tokens of several documents is a candidate for each of them, and the
attention kernels mask token pairs exactly); the diagonal block and the first block of the query block's
first document are always kept; the other candidates are kept in decreasing estimated mass until the kept
mass reaches tau of the row (tau = 1 keeps every candidate); ``max_density`` then caps the kept count at
floor(max_density * candidates) by dropping the lowest-mass blocks, never the always-kept ones; a tile
budget (``BlockRanking.select(max_tiles=...)``) finally bounds the whole call's kept tiles by dropping the
lowest-mass blocks across all rows and heads, which loses the least estimated mass for the tiles saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .attention import resolve_backend
from .layout import (
    PackedDocuments,
    as_packed_documents,
    check_power_of_two,
    check_qk,
    forced_tiles,
    group_doc_range,
    num_blocks,
    striped_blocks,
)
from .ring import context_unshard, group_place

# Stride-level score elements (heads x query groups x key groups) per chunk of query blocks.
_CHUNK_ELEMENTS = 1 << 24
# Estimated-mass thresholds among which ``per_head_tau`` picks each head's (the last keeps every candidate).
_CALIBRATION_GRID = [round(0.30 + 0.01 * i, 2) for i in range(70)] + [1.0]
ESTIMATES = ("antidiagonal", "sampled")
SELECTION_OPTIONS = {"estimate": "antidiagonal", "sink_blocks": 1, "local_blocks": 1, "recall_probes": 0,
                     "per_head_tau": False}
"""Keyword options of the selection functions, with their defaults (the selection as it was before them):

- ``estimate``: ``antidiagonal`` (XAttention: one score per stride tile, the sum of its antidiagonal's q.k
  products, softmax over stride tiles) or ``sampled`` (the same S products per tile, each its own query token's
  score of one sampled key, softmax per query token over its sampled keys: an unbiased sample of each token's
  attention row at the same cost, which sees single hot keys that an averaged logit hides);
- ``sink_blocks``: always keep this many first blocks of the query block's first document (0: none);
- ``local_blocks``: always keep this many causal blocks ending at the diagonal (1: the diagonal alone);
- ``recall_probes``: exact attention rows of this many seeded tokens per query block, on which the estimated
  kept mass is calibrated (``SelectionStats.kept_mass`` becomes honest on average; 0: off; costs
  probes x T x D per query block and head);
- ``per_head_tau``: with probes, tau is each head's target exact recall on them (the head's top-p threshold on
  the estimated mass is the least of a grid reaching it), rather than a threshold on the estimated mass.
"""


def selection_options(**options) -> dict:
    """``SELECTION_OPTIONS`` with ``options`` applied, checked."""
    unknown = set(options) - set(SELECTION_OPTIONS)
    if unknown:
        raise TypeError(f"unknown selection options {sorted(unknown)}; allowed: {sorted(SELECTION_OPTIONS)}")
    merged = {**SELECTION_OPTIONS, **options}
    if merged["estimate"] not in ESTIMATES:
        raise ValueError(f"estimate must be one of {ESTIMATES}, got {merged['estimate']!r}")
    for name, least in (("sink_blocks", 0), ("local_blocks", 1), ("recall_probes", 0)):
        if not isinstance(merged[name], int) or isinstance(merged[name], bool) or merged[name] < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {merged[name]!r}")
    if not isinstance(merged["per_head_tau"], bool):
        raise ValueError(f"per_head_tau must be true or false, got {merged['per_head_tau']!r}")
    if merged["per_head_tau"] and not merged["recall_probes"]:
        raise ValueError("per_head_tau needs recall_probes >= 1: the probes measure each head's exact recall")
    return merged


@dataclass
class LayerBudget:
    """The sparse-attention budget of one layer: top-p threshold, optional density cap per query row, and
    an optional scale on the layer's kept tiles relative to its base budget (what dynamic sparsity tuning
    moves: at most ``density_scale`` times the tiles the base budget keeps in this layer, the blocks of least
    estimated mass across the layer dropped first; relative, so an error in the estimated base density
    cannot make a rank sparser or denser than intended)."""

    tau: float
    max_density: float | None = None
    density_scale: float | None = None



class KnownBudget(NamedTuple):
    """A budget the ranking kernel applied while it ranked: each row's kept count and kept share of its mass,
    and the mask, or the masses of the optional blocks a tile bound cuts from (``selection_triton``)."""

    kept: torch.Tensor  # int64 [Hq, nB]
    kept_mass: torch.Tensor  # float [Hq, nB]
    mask: torch.Tensor | None = None  # bool [Hq, nB, nB]
    optional: torch.Tensor | None = None  # float [Hq, nB, nB] in rank order, -1 outside [forced, kept)
    document_tiles: torch.Tensor | None = None  # int32 [2, docs]: kept tiles, candidate tiles of all heads


@dataclass(frozen=True)
class BlockRanking:
    """Every row's candidate key blocks ranked once: always-kept blocks first, then by estimated mass.

    Any budget keeps a prefix of each row's ranking, so budgets are counts per row and several of them
    (DST's base and moved budgets, the densities other taus would give) cost one scoring.
    """

    candidates: torch.Tensor  # int64 [nB], candidate key blocks of each query block (same for all heads)
    forced: torch.Tensor  # int64 [nB], always-kept blocks of each query block
    order: torch.Tensor  # int64 [Hq, nB, nB], key blocks in rank order
    sorted_mass: torch.Tensor  # float [Hq, nB, nB], their estimated mass (non-candidates 0)
    cumulative: torch.Tensor  # float [Hq, nB, nB], estimated mass of the blocks ranked up to each rank
    # exact mass of each row's probe tokens (``recall_probes``) on its blocks in rank order, cumulative; None: no probes
    probe_cumulative: torch.Tensor | None = None  # float [Hq, nB, nB]
    per_head_tau: bool = False  # tau is each head's target exact recall on the probe tokens
    # the KnownBudgets the ranking kernel applied on the way, in the order of the budgets it was given
    # (``select_with_budget``'s budget in use, then its base unless the same): found by place, not by value, so that
    # torch.compile need not specialise on a budget's values
    known: tuple = field(default=(), compare=False, repr=False)
    known_totals: dict = field(default_factory=dict, compare=False, repr=False)  # {heads: candidate tiles}
    q_blocks = None  # the query blocks the rows are (None: every block of the stream); not a field here

    def kept_at(self, taus, max_density: float | None = None, max_tiles=None) -> torch.Tensor:
        """[Hq, nB, len(taus)] blocks each row keeps at each tau, with the per-row cap ``max_density`` and a
        bound ``max_tiles`` (int or 0-d tensor) on the kept tiles of all rows together."""
        if self.per_head_tau:
            count = self._calibrated_counts(taus, max_density)
        else:
            count = _kept_counts(self.cumulative, self.candidates, self.forced, taus, max_density)
        if max_tiles is None:
            return count
        return torch.stack([self._within(count[..., i], max_tiles) for i in range(count.shape[-1])], dim=-1)

    def _calibrated_counts(self, taus, max_density: float | None) -> torch.Tensor:
        """Top-p counts [Hq, nB, M] whose exact recall on the probe tokens reaches each tau, head by head: each
        head keeps, at every row, the estimated-mass top-p prefix of the least threshold of ``_CALIBRATION_GRID``
        whose probe recall over all the head's rows (the whole stream's) is at least tau, then the cap."""
        _check_taus(taus)
        taus = torch.as_tensor(taus, dtype=self.cumulative.dtype, device=self.cumulative.device).reshape(-1)
        grid = torch.as_tensor(_CALIBRATION_GRID, dtype=taus.dtype, device=taus.device)
        counts = _kept_counts(self.cumulative, self.candidates, self.forced, grid, None)
        kept = self.probe_cumulative.gather(-1, (counts - 1).clamp(min=0))  # [Hq, nB, G]
        rows = self._total(torch.ones_like(kept[0, :, 0]).sum())
        recall = self._total(kept.sum(dim=1)) / rows  # [Hq, G], non-decreasing: the masks are nested
        reached = recall[:, None, :] >= taus[None, :, None] - 1e-6  # [Hq, M, G]; the last grid point keeps all
        reached[..., -1] = True
        pick = reached.float().argmax(dim=-1)  # [Hq, M]: first grid point reaching each tau
        count = counts.gather(-1, pick[:, None, :].expand(-1, counts.shape[1], -1))
        if max_density is not None:
            check_fraction("max_density", max_density)
            cap = torch.maximum(self.forced, (max_density * self.candidates).floor().long())
            count = torch.minimum(count, cap[:, None])
        return count

    def _within(self, count: torch.Tensor, max_tiles) -> torch.Tensor:
        """``count`` [Hq, nB] cut to at most ``max_tiles`` kept tiles (never below the always-kept ones): the
        optional blocks (ranked after the always-kept ones) of least estimated mass go first, across rows and
        heads. One threshold on the mass, no host synchronisation; tied masses at it are all dropped."""
        forced, mass = self._optional_mass(count)
        ordered = mass.flatten().sort(descending=True).values
        spare = torch.as_tensor(max_tiles, device=count.device) - forced.sum()
        first_dropped = ordered.gather(0, spare.clamp(0, ordered.numel() - 1).long().reshape(1))
        return forced + (mass > first_dropped).sum(dim=-1)

    def _optional_mass(self, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(forced counts [Hq, nB], the ``sorted_mass`` of the optional blocks ``count`` keeps, -1 elsewhere)."""
        forced = self.forced.expand_as(count)
        ranks = torch.arange(self.order.shape[-1], device=count.device)
        optional = (ranks >= forced[..., None]) & (ranks < count[..., None])
        return forced, torch.where(optional, self.sorted_mass, torch.full_like(self.sorted_mass, -1.0))

    def _total(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over every row of the stream: these rows are all of them."""
        return x

    def candidate_tiles(self, num_heads: int) -> torch.Tensor:
        """0-d: the candidate tiles of ``num_heads`` heads, computed once for all the budgets priced on this ranking."""
        if num_heads not in self.known_totals:
            self.known_totals[num_heads] = self.candidates.sum() * num_heads
        return self.known_totals[num_heads]

    @property
    def row_mass(self) -> torch.Tensor:
        """float [Hq, nB, 1], the estimated mass of each row (1 up to rounding)."""
        return self.cumulative[..., -1:]

    def select(
        self, tau: float, max_density: float | None = None, max_tiles=None
    ) -> tuple[torch.Tensor, "SelectionStats"]:
        """The block mask [Hq, nB, nB] of this budget and its ``SelectionStats``."""
        check_fraction("tau", tau)
        if max_density is not None:
            check_fraction("max_density", max_density)
        stats = self.stats(self.kept_at([tau], max_density, max_tiles)[..., 0])
        return stats.mask(), stats

    def budget_stats(self, tau: float, max_density: float | None = None) -> "SelectionStats":
        """The ``SelectionStats`` of a budget without a tile bound."""
        return self.stats(self.kept_at([tau], max_density)[..., 0])

    def stats(self, kept: torch.Tensor) -> "SelectionStats":
        """The ``SelectionStats`` of keeping the first ``kept`` [Hq, nB] blocks of each row's ranking."""
        last = (kept - 1).clamp(min=0)[..., None]
        kept_mass = self.cumulative.gather(-1, last)[..., 0] / self.row_mass[..., 0]
        if self.probe_cumulative is not None:
            kept_mass = self._calibrated_mass(kept_mass, self.probe_cumulative.gather(-1, last)[..., 0])
        return SelectionStats(self, kept, kept_mass)

    def _calibrated_mass(self, estimated: torch.Tensor, probed: torch.Tensor) -> torch.Tensor:
        """Each row's estimated kept mass [Hq, nB] moved by its head's mean error on the probe tokens (exact
        kept mass minus estimated, over all the head's rows): a difference estimator, so the head's mean
        estimate is the probes' exact recall while the rows keep the estimate's spread."""
        rows = self._total(torch.ones_like(estimated[0]).sum())
        error = self._total((probed - estimated).sum(dim=1)) / rows  # [Hq]
        return (estimated + error[:, None]).clamp(0.0, 1.0)


@dataclass(frozen=True)
class SelectionStats:
    """What one selection kept, per (query head, query block) row, and what other budgets would keep.

    Densities are kept tiles over candidate tiles (causal tiles within documents). ``mean_density`` weights
    rows by their candidate count, so it is the fraction of dense attention work that remains: the number
    the latency model takes. ``kept_mass`` is the estimated (not exact) share of the attention mass kept;
    ``attention_recall`` measures the exact one.
    """

    ranking: BlockRanking
    kept: torch.Tensor  # int64 [Hq, nB]
    kept_mass: torch.Tensor  # float [Hq, nB]
    means: dict = field(default_factory=dict, compare=False, repr=False)  # computed once: a layer logs them twice

    @property
    def candidates(self) -> torch.Tensor:
        return self.ranking.candidates

    def mask(self) -> torch.Tensor:
        """The block mask [Hq, rows, nB] (rows: the ranking's query blocks): each row's first ``kept`` blocks of
        its ranking."""
        order = self.ranking.order
        keep_sorted = torch.arange(order.shape[-1], device=self.kept.device) < self.kept[..., None]
        return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)

    def under(self, budget: LayerBudget) -> "SelectionStats":
        """What ``budget`` keeps from the same ranking, its ``density_scale`` counted against the tiles these
        stats keep (as the base budget's): a move priced without scoring again."""
        kept = self.ranking.kept_at([budget.tau], budget.max_density, _max_tiles(self.ranking, budget, self.kept))
        return self.ranking.stats(kept[..., 0])

    def mean_density(self) -> torch.Tensor:
        """0-d: kept tiles / candidate tiles over all heads and rows."""
        if "density" not in self.means:
            self.means["density"] = self.kept.sum() / self.ranking.candidate_tiles(self.kept.shape[0])
        return self.means["density"]

    def mean_kept_mass(self) -> torch.Tensor:
        """0-d: mean over rows of the estimated kept share of attention mass (the estimated recall)."""
        if "kept_mass" not in self.means:
            self.means["kept_mass"] = self.kept_mass.float().mean()
        return self.means["kept_mass"]

    def kept_at(self, taus, max_density: float | None = None) -> torch.Tensor:
        """[Hq, nB, len(taus)] blocks each row would keep at each tau (and cap), from the same ranking."""
        return self.ranking.kept_at(taus, max_density)

    def density_at(self, taus, max_density: float | None = None) -> torch.Tensor:
        """[len(taus)] mean density (as ``mean_density``) that each tau would give, optionally with a cap:
        one searchsorted over the sorted cumulative masses, no rescoring (how DST hits a target cost)."""
        kept = self.kept_at(taus, max_density)
        return kept.sum(dim=(0, 1)) / self.ranking.candidate_tiles(kept.shape[0])


def check_fraction(name: str, value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"{name} must lie in (0, 1], got {value!r}")


def _check_taus(taus) -> None:
    """Every tau in (0, 1]; a tensor of them is checked where it is made (no device read here)."""
    if not isinstance(taus, torch.Tensor):
        bad = [tau for tau in taus if not 0 < tau <= 1]
        if bad:
            raise ValueError(f"every tau must lie in (0, 1], got {list(taus)}")


def _kept_counts(cumulative, candidates, forced, taus, max_density) -> torch.Tensor:
    """Top-p counts [Hq, nB, M] for M values of tau: the ranks whose preceding mass is below tau of the row (one
    more than the ranks whose mass up to them is below it), at least the forced blocks, at most the candidates,
    then the cap (never below the forced blocks). A single tau given as a number enters as a scalar, so that a
    new budget costs no transfer to the device."""
    _check_taus(taus)
    all_candidates = candidates[:, None]
    row_mass = cumulative[..., -1:]
    if not isinstance(taus, torch.Tensor) and len(taus) == 1:
        tau = float(taus[0])
        if tau >= 1:
            count = all_candidates.expand(*cumulative.shape[:-1], 1)
        else:
            count = torch.searchsorted(cumulative, row_mass * tau) + 1
    else:
        taus = torch.as_tensor(taus, dtype=cumulative.dtype, device=cumulative.device).reshape(-1)
        count = torch.searchsorted(cumulative, (taus * row_mass).contiguous()) + 1
        count = torch.where(taus >= 1, all_candidates, count)
    count = torch.minimum(torch.maximum(count, forced[:, None]), all_candidates)
    if max_density is not None:
        check_fraction("max_density", max_density)
        cap = torch.maximum(forced, (max_density * candidates).floor().long())
        count = torch.minimum(count, cap[:, None])
    return count


@torch.library.custom_op(
    "sparsebalance::estimate_block_mass", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor doc, int block_size, int stride, float scale, Tensor? q_blocks=None) -> Tensor",
)
def estimate_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    doc: torch.Tensor,
    block_size: int,
    stride: int,
    scale: float,
    q_blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """[Hq, nQ, nB] fp32 estimated attention mass of each block, rows normalised over candidates (torch).

    k [T, Hkv, D] and ``doc`` [T] are the whole stream's; q holds the tokens of the query blocks ``q_blocks``
    (increasing global block indices, default every block: then q is the whole stream [T, Hq, D]). Chunks
    are cut at the same global blocks and score the same key columns whichever rows are asked for, so a
    context-parallel rank's rows are the whole stream's rows of those blocks, up to the rounding of matmuls
    with fewer rows.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    num_q_heads = q.shape[1]
    group = num_q_heads // num_kv_heads
    per_block = block_size // stride
    nb = num_blocks(num_tokens, block_size)
    blocks = torch.arange(nb) if q_blocks is None else q_blocks.cpu()
    num_groups = -(-num_tokens // stride)
    q = F.pad(q.float(), (0, 0, 0, 0, 0, blocks.numel() * block_size - q.shape[0]))
    k = F.pad(k.float(), (0, 0, 0, 0, 0, num_groups * stride - num_tokens))
    # Row a of qs dotted with row b of ks is the antidiagonal sum of the stride tile (a, b).
    qs = q.reshape(-1, stride, num_kv_heads, group, head_dim).permute(2, 3, 0, 1, 4)
    qs = qs.reshape(num_kv_heads, group, -1, stride * head_dim)
    ks = k.reshape(num_groups, stride, num_kv_heads, head_dim).flip(1).permute(2, 0, 1, 3)
    ks = ks.reshape(num_kv_heads, 1, num_groups, stride * head_dim)
    first, last = group_doc_range(doc, stride)
    groups = torch.arange(num_groups, device=q.device)
    within = torch.arange(per_block)
    mass = q.new_zeros(num_q_heads, blocks.numel(), nb)
    blocks_per_chunk = max(1, _CHUNK_ELEMENTS // (num_q_heads * num_groups) // per_block)
    starts = torch.arange(0, nb + blocks_per_chunk, blocks_per_chunk).clamp(max=nb)
    rows_at = torch.searchsorted(blocks, starts).tolist()  # this call's rows of each chunk of global blocks
    for b0, b1, i0, i1 in zip(starts.tolist(), starts[1:].tolist(), rows_at, rows_at[1:]):
        if i0 == i1:
            continue
        g1 = min(b1 * per_block, num_groups)
        rows = (blocks[i0:i1, None] * per_block + within).flatten()  # global stride groups
        rows = rows[rows < num_groups].to(q.device)  # the last block of the stream may be partial
        r0 = i0 * per_block
        scores = (qs[:, :, r0 : r0 + rows.numel()] @ ks[:, :, :g1].transpose(-1, -2)).mul_(scale / stride)
        allowed = (groups[None, :g1] <= rows[:, None]) & (first[rows, None] <= last[None, :g1])
        probs = torch.softmax(scores.masked_fill_(~allowed, float("-inf")), dim=-1)
        probs = F.pad(probs, (0, b1 * per_block - g1, 0, (i1 - i0) * per_block - rows.numel()))
        mass[:, i0:i1, :b1] = probs.view(num_q_heads, i1 - i0, per_block, b1, per_block).sum(dim=(2, 4))
    return mass / mass.sum(dim=-1, keepdim=True)


def _query_positions(num_tokens: int, block_size: int, blocks: torch.Tensor) -> torch.Tensor:
    """Global token positions of the query rows of ``blocks`` (B per block; past the stream's end: -1)."""
    pos = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
    return torch.where(pos < num_tokens, pos, torch.full_like(pos, -1))


@torch.library.custom_op(
    "sparsebalance::sampled_block_mass", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor doc, int block_size, int stride, float scale, Tensor? q_blocks=None) -> Tensor",
)
def sampled_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    doc: torch.Tensor,
    block_size: int,
    stride: int,
    scale: float,
    q_blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """[Hq, nQ, nB] fp32 estimated attention mass of each block (``estimate="sampled"``), rows normalised.

    Query token t scores one key of every stride group g, token g * S + (S - 1 - t mod S): the S pairs of the
    antidiagonal of each stride tile, the products ``estimate_block_mass`` sums, here kept apart. Each token's
    sampled scores (causal, same document, token by token) get a softmax of their own, an estimate of its
    attention row with every group represented by one key; a block's mass is its groups' share, averaged over
    the block's tokens. Arguments as ``estimate_block_mass``.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    num_q_heads = q.shape[1]
    group = num_q_heads // num_kv_heads
    nb = num_blocks(num_tokens, block_size)
    blocks = torch.arange(nb) if q_blocks is None else q_blocks.cpu()
    pos = _query_positions(num_tokens, block_size, blocks).to(q.device)
    num_groups = -(-num_tokens // stride)
    per_block = block_size // stride
    qf = F.pad(q.float(), (0, 0, 0, 0, 0, pos.numel() - q.shape[0]))
    kf = F.pad(k.float(), (0, 0, 0, 0, 0, num_groups * stride - num_tokens)).view(num_groups, stride, num_kv_heads, head_dim)
    key_doc = F.pad(doc, (0, num_groups * stride - num_tokens), value=-1).view(num_groups, stride)
    key_pos = torch.arange(num_groups * stride, device=q.device).view(num_groups, stride)
    row_block = torch.arange(pos.numel(), device=q.device) // block_size
    row_doc = torch.where(pos >= 0, doc[pos.clamp(min=0)], torch.full_like(pos, -2))
    mass = q.new_zeros(num_q_heads, blocks.numel(), nb, dtype=torch.float32)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // (num_q_heads * num_groups))
    for offset in range(stride):
        key = stride - 1 - offset
        rows_all = torch.nonzero((pos % stride == offset) & (pos >= 0)).flatten()
        ks = kf[:, key].permute(1, 0, 2)[:, None]  # [Hkv, 1, G, D]
        for rows in rows_all.split(rows_per_chunk):
            qs = qf[rows].view(-1, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, g, R, D]
            scores = (qs @ ks.transpose(-1, -2)).mul_(scale).reshape(num_q_heads, rows.numel(), num_groups)
            allowed = (key_pos[None, :, key] <= pos[rows, None]) & (key_doc[None, :, key] == row_doc[rows, None])
            probs = torch.softmax(scores.masked_fill_(~allowed, float("-inf")), dim=-1).nan_to_num_(0.0)
            probs = F.pad(probs, (0, nb * per_block - num_groups)).view(num_q_heads, rows.numel(), nb, per_block)
            mass.index_add_(1, row_block[rows], probs.sum(dim=-1))
    return mass / mass.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)


@torch.library.custom_op(
    "sparsebalance::probe_block_mass", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor doc, int block_size, float scale, int probes, Tensor? q_blocks=None, "
           "int seed=0) -> Tensor",
)
def probe_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    doc: torch.Tensor,
    block_size: int,
    scale: float,
    probes: int,
    q_blocks: torch.Tensor | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """[Hq, nQ, nB] fp32 exact attention mass on each key block of ``probes`` seeded tokens of each query block
    (causal, within the token's document), averaged over the block's probes: what ``recall_probes`` measures.
    The probes of a global block are the same whichever rows are asked for (``q_blocks`` as in
    ``estimate_block_mass``)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    num_q_heads = q.shape[1]
    nb = num_blocks(num_tokens, block_size)
    blocks = torch.arange(nb) if q_blocks is None else q_blocks.cpu()
    # The same offsets for a block wherever it is asked for: drawn for every block of the stream, then indexed.
    draws = torch.rand(nb, probes, generator=torch.Generator().manual_seed(seed))
    sizes = (num_tokens - torch.arange(nb) * block_size).clamp(max=block_size)
    offsets = (draws * sizes[:, None]).long().clamp(max=block_size - 1)[blocks]  # [nQ, P]
    local = torch.arange(blocks.numel())[:, None] * block_size + offsets  # rows of q
    pos = (blocks[:, None] * block_size + offsets).flatten().to(q.device)
    kf = k.float().repeat_interleave(num_q_heads // num_kv_heads, dim=1).transpose(0, 1)  # [Hq, T, D]
    keys = torch.arange(num_tokens, device=q.device)
    exact = []
    for rows, at in zip(local.flatten().split(64), pos.split(64)):
        scores = (q[rows.to(q.device)].float().transpose(0, 1) @ kf.transpose(1, 2)) * scale  # [Hq, R, T]
        allowed = (keys[None, :] <= at[:, None]) & (doc[None, :] == doc[at, None])
        probs = torch.softmax(scores.masked_fill_(~allowed, float("-inf")), dim=-1)
        exact.append(F.pad(probs, (0, nb * block_size - num_tokens)).view(num_q_heads, -1, nb, block_size).sum(-1))
    return torch.cat(exact, dim=1).view(num_q_heads, blocks.numel(), probes, nb).mean(dim=2)


@estimate_block_mass.register_fake
@sampled_block_mass.register_fake
def _block_mass_shape(q, k, doc, block_size, stride, scale, q_blocks=None):
    return _mass_like(q, k, block_size, q_blocks)


@probe_block_mass.register_fake
def _probe_mass_shape(q, k, doc, block_size, scale, probes, q_blocks=None, seed=0):
    return _mass_like(q, k, block_size, q_blocks)


def _mass_like(q, k, block_size, q_blocks) -> torch.Tensor:
    """An empty [Hq, nQ, nB] fp32 block-mass tensor: what torch.compile needs to know of the estimators, whose
    chunking reads sizes on the host and which it therefore calls without tracing them (custom ops)."""
    nb = num_blocks(k.shape[0], block_size)
    return q.new_empty(q.shape[1], nb if q_blocks is None else q_blocks.shape[0], nb, dtype=torch.float32)


def rank_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor | PackedDocuments,
    *,
    block_size: int,
    stride: int = 16,
    scale: float | None = None,
    backend: str = "auto",
    **options,
) -> BlockRanking:
    """Scores every candidate block (module docstring) and ranks each row's blocks once; ``select`` then
    applies budgets. Arguments as ``select_blocks``; ``options`` are ``SELECTION_OPTIONS``."""
    return _rank_stream(q, k, cu_seqlens, block_size, stride, scale, backend, options)


def _rank_stream(q, k, cu_seqlens, block_size, stride, scale, backend, options, budgets=(), first=None):
    """``rank_blocks``, passing ``budgets`` to the ranking (``_rank_rows``)."""
    options = selection_options(**options)
    estimate, ranker, scale = _scoring(q, k, block_size, stride, scale, backend, options)
    documents = as_packed_documents(cu_seqlens, q.shape[0], block_size)
    return BlockRanking(*_rank_rows(q, k, documents, block_size, stride, scale, estimate, ranker, options=options,
                                    budgets=budgets, first=first))


def _scoring(q, k, block_size: int, stride: int, scale, backend: str, options: dict):
    """Checks the scoring arguments (``as_packed_documents`` checks the document bounds); returns (the backend's mass
    estimate, its ranking of the scored rows, scale)."""
    check_power_of_two("block_size", block_size)
    check_power_of_two("stride", stride)
    if stride > block_size:
        raise ValueError(f"stride ({stride}) must not exceed block_size ({block_size})")
    check_qk(q, k)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if _scores_with_triton(resolve_backend(backend, q.device), q.device):
        from . import selection_triton

        # the Triton kernel scores antidiagonals only
        estimate = sampled_block_mass if options["estimate"] == "sampled" else selection_triton.estimate_block_mass
        return estimate, selection_triton.rank_block_mass, scale
    estimate = sampled_block_mass if options["estimate"] == "sampled" else estimate_block_mass
    return estimate, rank_block_mass, scale


_BLOCK_BITS = (1 << 20) - 1  # rank keys hold a block index in their low 20 bits


def _scores_with_triton(backend: str, device: torch.device) -> bool:
    """The Triton kernels score and rank for the triton backend, and for flex on CUDA (flex has no scoring)."""
    return backend == "triton" or (backend == "flex" and device.type == "cuda")


def rank_keys(mass: torch.Tensor, candidates: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """int64 keys whose descending order is each row's ranking: always-kept blocks first, then the other
    candidates by estimated mass, then the rest; ties go to the lower block. The key packs, from the top bit
    down, forced, candidate, the mass's float bits (non-negative floats order as their bits) and the block
    index reversed, so one sort ranks and no two keys are equal."""
    blocks = torch.arange(mass.shape[-1], device=mass.device)
    bits = torch.where(candidates, mass.float().view(torch.int32), 0).long()
    return (forced.long() << 52) | (candidates.long() << 51) | (bits << 20) | (_BLOCK_BITS - blocks)


def rank_block_mass(mass: torch.Tensor, documents: PackedDocuments, sink_blocks: int, local_blocks: int,
                    q_blocks: torch.Tensor | None = None, budgets: tuple = (), first: str | None = None) -> tuple:
    """Each row of estimated block masses ``mass`` [Hq, nQ, nB] ranked by ``rank_keys``, for the query blocks
    ``q_blocks`` (None: every block) of the stream of ``documents``: (candidate and forced blocks per query block
    [nQ], order, sorted_mass, cumulative [Hq, nQ, nB], as ``BlockRanking`` holds them, and the budgets applied on
    the way, none here: ``budgets`` and ``first`` serve the Triton ranking, which applies them in the same
    launch)."""
    candidates = documents.candidates
    forced = forced_tiles(documents.doc, documents.cu_seqlens, documents.block_size, sink_blocks, local_blocks)
    forced = forced & candidates
    if q_blocks is not None:
        candidates, forced = candidates[q_blocks], forced[q_blocks]
    order = rank_keys(mass, candidates, forced).argsort(dim=-1, descending=True)
    sorted_mass = torch.where(candidates, mass, 0.0).gather(-1, order)
    return candidates.sum(-1), forced.sum(-1), order, sorted_mass, sorted_mass.cumsum(dim=-1), ()


def _rank_rows(q, k, documents: PackedDocuments, block_size: int, stride: int, scale: float, estimate, ranker,
               q_blocks=None, options: dict | None = None, budgets: tuple = (), first: str | None = None) -> tuple:
    """``BlockRanking``'s fields for the query blocks ``q_blocks`` (None: all) of the stream of ``documents``
    whose keys are ``k``, scored by ``estimate`` and ranked by ``ranker`` (``rank_block_mass``), which may apply
    ``budgets`` ((tau, max_density) pairs) on the way; probes and per-head taus move counts and masses, so they
    take none."""
    options = selection_options(**(options or {}))
    if options["recall_probes"] or options["per_head_tau"]:
        budgets, first = (), None
    with torch.no_grad():
        doc = documents.doc
        mass = estimate(q, k, doc, block_size, stride, scale)
        candidates, forced, order, sorted_mass, cumulative, known = ranker(
            mass, documents, options["sink_blocks"], options["local_blocks"], q_blocks, budgets, first
        )
        probe = None
        if options["recall_probes"]:
            probe = probe_block_mass(q, k, doc, block_size, scale, options["recall_probes"], q_blocks).gather(-1, order)
            ranks = torch.arange(order.shape[-1], device=order.device)
            probe = torch.where(ranks < candidates[:, None], probe, 0.0).cumsum(dim=-1)
        return candidates, forced, order, sorted_mass, cumulative, probe, options["per_head_tau"], known


def select_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor | PackedDocuments,
    *,
    block_size: int,
    tau: float,
    stride: int = 16,
    max_density: float | None = None,
    scale: float | None = None,
    return_stats: bool = False,
    backend: str = "auto",
    **options,
):
    """Block mask bool [Hq, ceil(T/B), ceil(T/B)] for ``block_sparse_attention`` (module docstring for the rule).

    q [T, Hq, D] and k [T, Hkv, D] of one packed stream (GQA: each query head is scored against its KV head);
    cu_seqlens int32 [docs + 1], or the stream's ``PackedDocuments`` (made once for all layers); tau in (0, 1];
    stride a power of two dividing block_size; max_density in (0, 1] or None; scale defaults to D ** -0.5. With
    ``return_stats`` returns ``(mask, SelectionStats)``.
    ``backend`` picks the scoring kernel like ``block_sparse_attention`` does. Not differentiable.
    ``rank_blocks(...).select(...)`` is the same in two steps, for several budgets or a tile budget.
    """
    _check_budget(tau, max_density)
    ranking = rank_blocks(q, k, cu_seqlens, block_size=block_size, stride=stride, scale=scale, backend=backend,
                          **options)
    return _selected(ranking, tau, max_density, return_stats)


def _check_budget(tau: float, max_density: float | None) -> None:
    check_fraction("tau", tau)
    if max_density is not None:
        check_fraction("max_density", max_density)


def _selected(ranking: BlockRanking, tau: float, max_density: float | None, return_stats: bool):
    """``select_blocks``' answer from a ranking: the mask, with its stats when asked for."""
    mask, stats = ranking.select(tau, max_density)
    return (mask, stats) if return_stats else mask


@dataclass(frozen=True)
class BudgetedSelection:
    """A layer's selection under a ``LayerBudget``: the block mask, what it kept (``SelectionStats``), what the
    base budget would have kept from the same ranking (``base_stats``: a moved budget's density and estimated
    recall against the base's are what tuning buys and costs), and each document's tiles at the base budget
    (``base_document_tiles`` [2, docs]: kept, and candidate, tiles over all heads), whose density predicts the
    cost of later batches."""

    mask: torch.Tensor
    stats: SelectionStats
    base_stats: SelectionStats
    base_document_tiles: torch.Tensor

    @property
    def base_document_density(self) -> torch.Tensor:
        """[docs] each document's kept over candidate tiles at the base budget (``tile_density``)."""
        return tile_density(self.base_document_tiles)


def select_with_budget(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor | PackedDocuments,
    budget: LayerBudget,
    base: LayerBudget,
    *,
    block_size: int,
    stride: int = 16,
    scale: float | None = None,
    backend: str = "auto",
    **options,
) -> BudgetedSelection:
    """``select_blocks`` under a whole ``LayerBudget``: tau, the per-row cap ``max_density``, and the layer's
    kept tiles bounded by ``density_scale`` times what ``base`` (the configured budget) keeps; plus every
    document's density at ``base``. One scoring serves both budgets. Arguments otherwise as ``select_blocks``.

    This is what a module tuned by ``DynamicSparsityTuning`` calls in each attention layer, with that layer's
    ``layer_budgets[i]`` and ``base_budgets[i]``: ignoring ``density_scale`` would leave the predicted balance
    improving while the measured one does not.
    """
    budgets = ((budget.tau, budget.max_density), (base.tau, base.max_density))
    check_qk(q, k)  # before the bounds, whose check takes q's length
    documents = as_packed_documents(cu_seqlens, q.shape[0], block_size)
    ranking = _rank_stream(q, k, documents, block_size, stride, scale, backend, options,
                           budgets[:1] if _is_base(budget, base) else budgets,
                           first="mask" if budget.density_scale is None else "optional")
    return _select_budgeted(ranking, budget, base, documents.cu_seqlens, q.shape[0], block_size)


def _is_base(budget: LayerBudget, base: LayerBudget) -> bool:
    """Whether ``budget`` is the base budget itself, whose counts then serve as the base's. Never while torch.compile
    traces: its guards can miss a comparison of two budgets and reuse the graph of one for another (the two counted
    apart give the same results)."""
    return budget == base and not torch.compiler.is_compiling()


def _select_budgeted(ranking: BlockRanking, budget: LayerBudget, base: LayerBudget, cu_seqlens, num_tokens: int,
                     block_size: int) -> BudgetedSelection:
    """``select_with_budget`` on a ranking of (some of) the query blocks of a stream of ``num_tokens``; tile
    counts that span the layer are the ranking's ``_total`` over the whole stream."""
    own = _is_base(budget, base) and budget.density_scale is None
    # what the ranking kernel applied: the budget in use first, the base last (the same one where they are equal)
    known, known_base = (ranking.known[0], ranking.known[-1]) if ranking.known else (None, None)
    if own:
        base_stats = None
    elif known_base is not None:
        base_stats = SelectionStats(ranking, known_base.kept, known_base.kept_mass)
    else:
        base_stats = ranking.budget_stats(base.tau, base.max_density)
    if budget.density_scale is not None and known is not None and known.optional is not None:
        from .selection_triton import cut_to_tiles  # the ranking kernel made ready for the cut

        kept, kept_mass, mask = cut_to_tiles(ranking, known, budget.density_scale, known_base.document_tiles[0])
        stats = SelectionStats(ranking, kept, kept_mass)
    elif budget.density_scale is None and known is not None and known.mask is not None:
        mask, stats = known.mask, SelectionStats(ranking, known.kept, known.kept_mass)
    else:
        mask, stats = ranking.select(budget.tau, budget.max_density,
                                     _max_tiles(ranking, budget, None if own else base_stats.kept))
    base_stats = stats if own else base_stats  # static runs and evaluation use the base itself
    if known_base is not None and known_base.document_tiles is not None:  # counted by the ranking kernel
        base_tiles = known_base.document_tiles
    else:
        tiles = _document_tiles(base_stats.kept, ranking.candidates, cu_seqlens, num_tokens, block_size,
                                ranking.q_blocks)
        base_tiles = ranking._total(tiles)
    return BudgetedSelection(mask, stats, base_stats, base_tiles)


def _max_tiles(ranking: BlockRanking, budget: LayerBudget, base_kept: torch.Tensor | None):
    """The layer's bound on kept tiles under ``budget``: its ``density_scale`` times the base budget's tiles
    (``base_kept`` [Hq, rows], summed over the stream); None without a scale."""
    if budget.density_scale is None:
        return None
    return (budget.density_scale * ranking._total(base_kept.sum())).floor()


def document_density(
    kept_rows: torch.Tensor, candidates: torch.Tensor, cu_seqlens: torch.Tensor, num_tokens: int, block_size: int
) -> torch.Tensor:
    """[docs] kept / causal tiles of each document, from a selection's kept blocks per row ``kept_rows``
    [Hq, nB] and candidate blocks per query block ``candidates`` [nB] (``BlockRanking``).

    A query block shared by two documents counts for the one it starts in; exact for block-aligned documents.
    A document starting no block (shorter than one, inside another's) is dense: it sees only forced blocks.
    """
    return tile_density(_document_tiles(kept_rows, candidates, cu_seqlens, num_tokens, block_size))


def _document_tiles(kept_rows, candidates, cu_seqlens, num_tokens, block_size, q_blocks=None) -> torch.Tensor:
    """[2, docs]: the kept and the candidate tiles over all heads of the query blocks ``q_blocks`` (None: all), each
    counted for the document it starts in; int64, so sums over ranks are exact."""
    block_starts = torch.arange(0, num_tokens, block_size, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    block_doc = torch.searchsorted(cu_seqlens[1:], block_starts, right=True)
    if q_blocks is not None:
        block_doc = block_doc[q_blocks]
    per_doc = candidates.new_zeros(2, len(cu_seqlens) - 1)
    per_doc.index_add_(1, block_doc, torch.stack([kept_rows.sum(0), candidates * kept_rows.shape[0]]))
    return per_doc


def tile_density(tiles: torch.Tensor) -> torch.Tensor:
    """Kept over candidate tiles, from ``tiles`` [..., 2, docs] (kept, candidate) of each document (a row never keeps
    more than its candidates); 1 where a document starts no block. Elementwise: the documents of many layers at
    once."""
    kept, covered = tiles.unbind(-2)
    return torch.where(covered > 0, kept / covered, 1.0)


# Selection for context parallelism: a stream held block-striped by the ranks of a group (``ring.py``).

_PROBES = 255  # multisection probes per all-reduce: 8 bits of the 32-bit key range a round


@dataclass(frozen=True)
class StripedRanking(BlockRanking):
    """A ``BlockRanking`` of the query blocks one rank of a context-parallel group holds in a block-striped
    stream (rows: global blocks rank, rank + W, ...; columns: all key blocks of the stream).

    Top-p and ``max_density`` are per row, so a rank's rows alone decide them. A tile budget (``max_tiles``)
    counts the whole layer, so it is cut at one group-wide mass threshold: the tiles the whole-stream
    ranking keeps. Asking for one is collective: every rank of the group asks for the same budgets.
    ``select`` returns the global bool [Hq, nB, nB] mask ``sparse_ring_attention`` takes, this rank's rows
    filled and the others False (the ring reads only its own rows); its stats cover this rank's rows.
    """

    group: object = None  # torch.distributed.ProcessGroup; None: the default group
    world_size: int = 1
    rank: int = 0
    q_blocks: torch.Tensor | None = None  # this rank's global query blocks (None: a group of one, all of them)

    def _total(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the group's ranks: every row of the stream."""
        if self.world_size == 1:
            return x
        x = x.clone()
        dist.all_reduce(x, group=self.group)
        return x

    def _within(self, count: torch.Tensor, max_tiles) -> torch.Tensor:
        """``BlockRanking._within`` with the threshold the whole stream's blocks give, found by
        ``_group_order_statistic`` on order keys of the masses, so only counts travel."""
        if self.world_size == 1:
            return super()._within(count, max_tiles)
        forced, mass = self._optional_mass(count)
        keys = _order_keys(mass)
        spare = torch.as_tensor(max_tiles, device=count.device) - self._total(forced.sum())
        spare = spare.clamp(0, mass.numel() * self.world_size - 1).long()
        first_dropped = _group_order_statistic(keys.flatten(), spare, self.group)
        return forced + (keys > first_dropped).sum(dim=-1)

    def select(
        self, tau: float, max_density: float | None = None, max_tiles=None
    ) -> tuple[torch.Tensor, SelectionStats]:
        rows, stats = super().select(tau, max_density, max_tiles)
        mask = rows.new_zeros(rows.shape[0], rows.shape[-1], rows.shape[-1])
        mask[:, self.rank :: self.world_size] = rows
        return mask, stats


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys in the order of the fp32 values ``x`` (-0 as +0): the bits, negative values' magnitude
    bits flipped so that a larger magnitude gives a smaller key."""
    bits = (x.float() + 0.0).view(torch.int32).long()
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _group_order_statistic(keys: torch.Tensor, index: torch.Tensor, group) -> int:
    """The key at ``index`` (0-d) of all the group's ``keys`` sorted in decreasing order, as if they were one
    tensor, without moving them: the least x with at most ``index`` keys above it, found by multisection of
    the 32-bit key range, each round one all-reduce of the counts above ``_PROBES`` probes (5 rounds).
    Collective: every rank calls it with the same ``index``."""
    keys = keys.sort().values
    lo, hi = -(2**31), 2**31 - 1  # the answer lies in [lo, hi]: no key is above hi
    steps = torch.arange(_PROBES, device=keys.device)
    while lo < hi:
        probes = lo + (hi - lo) * steps // _PROBES  # probes[0] = lo, all below hi
        above = keys.numel() - torch.searchsorted(keys, probes, right=True)
        dist.all_reduce(above, group=group)
        fits = (above <= index).tolist()
        if True in fits:
            first = fits.index(True)
            lo, hi = (lo if first == 0 else int(probes[first - 1]) + 1), int(probes[first])
        else:
            lo = int(probes[-1]) + 1
    return lo


def _gather_stream(x: torch.Tensor, group, world_size: int, block_size: int) -> torch.Tensor:
    """The whole stream of a tensor held block-striped by the group's ranks."""
    shards = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(shards, x.contiguous(), group=group)
    return context_unshard(shards, block_size=block_size)


def rank_blocks_striped(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor | PackedDocuments,
    *,
    block_size: int,
    group=None,
    stride: int = 16,
    scale: float | None = None,
    backend: str = "auto",
    **options,
) -> StripedRanking:
    """``rank_blocks`` for a stream held block-striped by the ranks of ``group`` (``context_shard``): ranks this
    rank's query blocks against the whole stream's keys. q [T/W, Hq, D] and k [T/W, Hkv, D] are this rank's
    shards (T a multiple of W * block_size), cu_seqlens the stream's global int32 [docs + 1]; ``group`` as
    ``sparse_ring_attention``'s. Collective: every rank of the group calls it.

    The scores need every key: each antidiagonal stride score reads all D elements of S keys, and a query's
    softmax spans all its causal keys, so pooled or strided block summaries would change the estimate and
    the mask. K is all-gathered (as MTraining does): each rank receives (W - 1) / W of the stream's K, one
    ring pass of K, and scores its own rows only, 1/W of the whole stream's scoring. The rows are computed
    in the whole stream's chunks against the same key columns; only the number of rows of each matmul
    differs, which can move a mass by an ulp (BLAS picks kernels by shape), so a mask differs from the
    whole stream's only where a block's mass lies within rounding of its row's top-p or the layer's cut.

    A group of W ranks scores with the torch estimate on q's device (the Triton kernel scores whole streams);
    a group of one is ``rank_blocks`` with ``backend``.
    """
    world_size, rank = group_place(group)
    if world_size > 1 and q.shape[0] % block_size:
        raise ValueError(
            f"q holds {q.shape[0]} tokens, not a multiple of block_size {block_size}: shard with context_shard "
            f"a stream padded to a multiple of world_size * block_size = {world_size * block_size}"
        )
    num_tokens = q.shape[0] * world_size
    options = selection_options(**options)
    estimate, ranker, scale = _scoring(q, k, block_size, stride, scale, backend, options)
    documents = as_packed_documents(cu_seqlens, num_tokens, block_size)
    q_blocks = None
    if world_size > 1:  # the torch kernels score and rank a subset of the rows
        q_blocks = striped_blocks(num_blocks(num_tokens, block_size), world_size, rank, q.device)
        torch_estimate = sampled_block_mass if options["estimate"] == "sampled" else estimate_block_mass
        estimate, ranker = partial(torch_estimate, q_blocks=q_blocks), rank_block_mass
        with torch.no_grad():
            k = _gather_stream(k.detach(), group, world_size, block_size)
    fields = _rank_rows(q, k, documents, block_size, stride, scale, estimate, ranker, q_blocks, options)
    return StripedRanking(*fields, group=group, world_size=world_size, rank=rank, q_blocks=q_blocks)


def select_blocks_striped(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor | PackedDocuments,
    *,
    block_size: int,
    tau: float,
    group=None,
    stride: int = 16,
    max_density: float | None = None,
    scale: float | None = None,
    return_stats: bool = False,
    backend: str = "auto",
    **options,
):
    """``select_blocks`` for a stream held block-striped by the ranks of ``group``: this rank's rows of the
    whole stream's mask, in the global bool [Hq, T/B, T/B] ``block_mask`` of ``sparse_ring_attention`` (other
    ranks' rows False). Arguments as ``rank_blocks_striped`` and ``select_blocks``; the stats cover this
    rank's rows. Collective: every rank of the group calls it."""
    _check_budget(tau, max_density)
    ranking = rank_blocks_striped(
        q, k, cu_seqlens, block_size=block_size, group=group, stride=stride, scale=scale, backend=backend, **options
    )
    return _selected(ranking, tau, max_density, return_stats)


def select_with_budget_striped(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor | PackedDocuments,
    budget: LayerBudget,
    base: LayerBudget,
    *,
    block_size: int,
    group=None,
    stride: int = 16,
    scale: float | None = None,
    backend: str = "auto",
    **options,
) -> BudgetedSelection:
    """``select_with_budget`` for a stream held block-striped by the ranks of ``group``: the mask as
    ``select_blocks_striped``'s, ``density_scale`` bounding the tiles of the whole layer (the base budget's
    tiles summed over the group, one group-wide threshold), stats of this rank's rows, and every document's
    base density over the whole stream, the same on every rank. Collective: every rank of the group calls it
    with the same budgets."""
    num_tokens = q.shape[0] * group_place(group)[0]
    documents = as_packed_documents(cu_seqlens, num_tokens, block_size)
    ranking = rank_blocks_striped(
        q, k, documents, block_size=block_size, group=group, stride=stride, scale=scale, backend=backend, **options
    )
    return _select_budgeted(ranking, budget, base, documents.cu_seqlens, num_tokens, block_size)
