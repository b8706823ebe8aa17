"""Packed-sequence attention for Hugging Face Qwen2, plugged in through transformers' AttentionInterface.

Qwen2 calls the registered function with q, k, v as [1, H, T, D] (KV heads not repeated) and no mask, so
the function applies causality and document boundaries itself from the ``AttentionContext`` that the
LightningModule passes as a model keyword argument (``sb_context``). Two backends:

- ``dense``: exact causal attention within each document (PyTorch SDPA per document);
- ``sparse``: XAttention-style block selection then block-sparse attention (``sparsebalance_pl.kernels``).

With a context-parallel group (``AttentionContext.context_parallel``) q, k and v are this rank's block-striped
rows of a stream the group shares: selection scores against the whole stream's keys with one group-wide
threshold, and attention runs the ring over the group (dense attention: the ring with every causal block).

The context also carries the per-layer budgets (moved by dynamic sparsity tuning), caches the chosen masks
so an activation-checkpointing recomputation reuses exactly the same mask, collects per-layer density and
estimated recall for logging, the density each document would have had at the base budgets (from the same
ranking, for predicting the next batches' cost), and times the attention calls, forward and backward: they
are free of collectives, unlike whole steps under FSDP or DDP.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from sparsebalance_pl.context_parallel import ContextParallel
from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.kernels.selection import SELECTION_OPTIONS, BudgetedSelection, LayerBudget, selection_options
from sparsebalance_pl.timing import AttentionTimer

ATTN_IMPLEMENTATION = "sparsebalance"
AttentionBackend = Literal["dense", "sparse"]
KernelBackend = Literal["auto", "torch", "triton"]


@dataclass
class AttentionConfig:
    """How attention is computed.

    Args:
        backend: ``dense`` (exact) or ``sparse`` (block selection + block-sparse attention).
        block_size: tokens per block for selection and sparse attention (power of two, 16..256).
        tau: top-p threshold in (0, 1]: each query block keeps the fewest key blocks whose estimated
            attention mass reaches this fraction of its row (1.0 keeps every causal block).
        stride: antidiagonal scoring stride of the selection (power of two dividing block_size).
        max_density: optional cap on the kept fraction of causal blocks per query row, in (0, 1].
        kernel_backend: ``auto`` (Triton on CUDA, torch on CPU), ``torch`` or ``triton``.
        recall_rows: measure each layer's exact recall on about this many sampled query rows per training
            micro-batch, drawn per document so that a document is measured on the same rows however it is
            packed (0: off; the estimated recall of the selection is always reported).
        estimate: how the selection estimates each block's attention mass: ``antidiagonal`` (XAttention's
            stride-tile antidiagonal sums) or ``sampled`` (each antidiagonal product its own query token's
            score of one sampled key: sees single hot keys; torch on every backend).
        sink_blocks: always keep this many first blocks of each query block's first document (>= 0).
        local_blocks: always keep this many causal blocks ending at the diagonal (>= 1: the diagonal alone).
        recall_probes: exact attention rows of this many seeded tokens per query block calibrate the
            estimated recall that DST and the logs read (0: off; costs probes x T x D per block and head).
        per_head_tau: with ``recall_probes``, ``tau`` becomes each head's target exact recall on the probes
            rather than a threshold on the estimated mass.

    The last five are ``sparsebalance_pl.kernels.selection.SELECTION_OPTIONS``; their defaults are its.
    """

    backend: AttentionBackend = "sparse"
    block_size: int = 64
    tau: float = 0.9
    stride: int = 16
    max_density: float | None = None
    kernel_backend: KernelBackend = "auto"
    recall_rows: int = 0
    estimate: str = "antidiagonal"
    sink_blocks: int = 1
    local_blocks: int = 1
    recall_probes: int = 0
    per_head_tau: bool = False

    def selection_options(self) -> dict:
        """The keyword options of the selection functions (``SELECTION_OPTIONS``) this config sets."""
        return {name: getattr(self, name) for name in SELECTION_OPTIONS}

    def __post_init__(self) -> None:
        if self.backend not in ("dense", "sparse"):
            raise ConfigError(f"attention.backend={self.backend!r} is unknown; allowed: 'dense', 'sparse'")
        if self.kernel_backend not in ("auto", "torch", "triton"):
            raise ConfigError(
                f"attention.kernel_backend={self.kernel_backend!r} is unknown; allowed: 'auto', 'torch', 'triton'"
            )
        if not _is_power_of_two(self.block_size) or not 16 <= self.block_size <= 256:
            raise ConfigError(
                f"attention.block_size={self.block_size} must be a power of two between 16 and 256"
            )
        if not _is_power_of_two(self.stride) or self.stride > self.block_size:
            raise ConfigError(
                f"attention.stride={self.stride} must be a power of two no larger than "
                f"attention.block_size={self.block_size}"
            )
        if not 0.0 < self.tau <= 1.0:
            raise ConfigError(f"attention.tau={self.tau} must lie in (0, 1]")
        if self.max_density is not None and not 0.0 < self.max_density <= 1.0:
            raise ConfigError(f"attention.max_density={self.max_density} must lie in (0, 1] or be null")
        if self.recall_rows < 0:
            raise ConfigError(f"attention.recall_rows={self.recall_rows} must be >= 0")
        try:
            selection_options(**self.selection_options())
        except ValueError as error:  # its messages start with the option's name
            raise ConfigError(f"attention.{error}") from None


def _is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


@dataclass
class LayerStats:
    """What one layer's selection kept, as tensors (no host sync inside the forward).

    ``base_document_density`` [docs]: each document's kept fraction of causal tiles had the layer used its
    base budget, counted from the same ranking (query blocks count for the document of their first token);
    ``base_density`` and ``base_estimated_recall`` are the layer's at the base budget, likewise; ``recall`` and
    ``base_recall`` the exact ones on the same sampled rows, when measured, and then ``probe_moves`` [2, 2]:
    (density, exact recall) of each of ``price_probes`` minus the base budget's, on those rows.
    """

    density: torch.Tensor
    estimated_recall: torch.Tensor
    base_document_density: torch.Tensor
    base_density: torch.Tensor
    base_estimated_recall: torch.Tensor
    recall: torch.Tensor | None = None
    base_recall: torch.Tensor | None = None
    probe_moves: torch.Tensor | None = None


@dataclass
class AttentionContext:
    """Per-forward state of the attention function, created by the module for each micro-batch.

    ``budgets`` are those in use (moved by dynamic sparsity tuning); ``base_budgets`` those against which
    ``LayerStats.base_document_density`` is counted (the configured ones; default: ``budgets``). With
    ``recall_rows`` > 0 each layer's exact recall is measured on about that many sampled query rows, outside the
    timed region (costs rows x T per head; not under context parallelism, where a rank lacks the other
    ranks' keys), at the budget in use and, on the same rows, at the base budget and at its ``price_probes``
    (``selections`` holds the layer's selection from the selection until then, so the other masks are built
    outside the timed region; ``measurement_timer`` times it, so that a rank's time can leave out work a run
    without ``recall_rows`` would not do). ``context_parallel``: the group sharing the stream, whose ranks must
    hold equal budgets; its ``masks`` then hold only this rank's striped rows, and ``ring_timer`` times the
    ring's waits (a part of ``timer``'s time).
    """

    cu_seqlens: torch.Tensor
    config: AttentionConfig
    budgets: list[LayerBudget]
    base_budgets: list[LayerBudget] | None = None
    timer: AttentionTimer | None = None
    ring_timer: AttentionTimer | None = None
    measurement_timer: AttentionTimer | None = None
    recall_rows: int = 0
    context_parallel: ContextParallel = field(default_factory=ContextParallel)
    masks: dict[int, torch.Tensor] = field(default_factory=dict)
    selections: dict[int, BudgetedSelection] = field(default_factory=dict)
    stats: dict[int, LayerStats] = field(default_factory=dict)

    @property
    def measures_recall(self) -> bool:
        return self.recall_rows > 0 and not self.context_parallel.active

    def mean_density(self) -> float | None:
        return _mean_of(s.density for s in self.stats.values())

    def mean_estimated_recall(self) -> float | None:
        return _mean_of(s.estimated_recall for s in self.stats.values())

    def mean_recall(self) -> float | None:
        return _mean_of(s.recall for s in self.stats.values() if s.recall is not None)

    def mean_base_recall(self) -> float | None:
        return _mean_of(s.base_recall for s in self.stats.values() if s.base_recall is not None)

    def mean_probe_moves(self) -> list[tuple[float, float]] | None:
        """Each price probe's (density, exact recall) against the base budget, mean over the measured layers."""
        moves = [s.probe_moves for s in self.stats.values() if s.probe_moves is not None]
        return [tuple(move) for move in torch.stack(moves).float().mean(0).tolist()] if moves else None


def _mean_of(values) -> float | None:
    values = list(values)
    return float(torch.stack([v.float() for v in values]).mean()) if values else None


def varlen_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Exact causal attention within each document of a packed stream; q [T, Hq, D], k/v [T, Hkv, D]."""
    bounds = cu_seqlens.tolist()
    enable_gqa = q.shape[1] != k.shape[1]
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qd, kd, vd = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs, dim=0)


def _ring_attention(q, k, v, mask, layer: int, ctx: AttentionContext, scale: float | None) -> torch.Tensor:
    from sparsebalance_pl.kernels import sparse_ring_attention

    cp = ctx.context_parallel
    return sparse_ring_attention(
        q, k, v, ctx.cu_seqlens, block_size=ctx.config.block_size, group=cp.group, block_mask=mask,
        backend=ctx.config.kernel_backend, scale=scale, node_size=cp.node_size, label=f"layer {layer}",
        wait_timer=ctx.ring_timer,
    )


def _dense_attention(q, k, v, layer: int, ctx: AttentionContext, scale: float | None) -> torch.Tensor:
    if ctx.context_parallel.active:
        return _ring_attention(q, k, v, None, layer, ctx, scale)
    return varlen_causal_attention(q, k, v, ctx.cu_seqlens, scale)


def _sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, ctx: AttentionContext, scale: float | None
) -> torch.Tensor:
    from sparsebalance_pl.kernels import block_sparse_attention, select_with_budget, select_with_budget_striped
    from sparsebalance_pl.kernels.layout import striped_blocks

    cfg, cp = ctx.config, ctx.context_parallel
    mask = ctx.masks.get(layer)
    if mask is None:  # an activation-checkpointing recomputation reuses the mask (and skips the collectives)
        base = (ctx.base_budgets or ctx.budgets)[layer]
        settings = dict(block_size=cfg.block_size, stride=cfg.stride, scale=scale, backend=cfg.kernel_backend,
                        **cfg.selection_options())
        if cp.active:
            selection = select_with_budget_striped(
                q.detach(), k.detach(), ctx.cu_seqlens, ctx.budgets[layer], base, group=cp.group, **settings
            )
        else:
            selection = select_with_budget(q.detach(), k.detach(), ctx.cu_seqlens, ctx.budgets[layer], base, **settings)
        mask = selection.mask
        if ctx.measures_recall:  # the base budget and its price probes are measured beside the budget in use
            ctx.selections[layer] = selection
        if cp.active:  # the ring reads only this rank's rows: keep W times less for the recomputation
            mask = mask[:, striped_blocks(mask.shape[1], cp.size, cp.rank, mask.device)]
        ctx.masks[layer] = mask
        ctx.stats[layer] = LayerStats(
            density=selection.stats.mean_density(),
            estimated_recall=selection.stats.mean_kept_mass(),
            base_document_density=selection.base_document_density,
            base_density=selection.base_stats.mean_density(),
            base_estimated_recall=selection.base_stats.mean_kept_mass(),
        )
    if cp.active:
        return _ring_attention(q, k, v, mask, layer, ctx, scale)
    return block_sparse_attention(
        q, k, v, mask, ctx.cu_seqlens, block_size=cfg.block_size, scale=scale, backend=cfg.kernel_backend
    )


def sparsebalance_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sb_context: AttentionContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered with transformers; returns [1, T, H, D] like Hugging Face's own backends."""
    if sb_context is None:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} needs the model to be called with "
            "sb_context=AttentionContext(...) (the SparseQwen module does this)"
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed stream per call, got batch size {query.shape[0]}")
    if attention_mask is not None:
        raise ValueError("packed attention applies document and causal masking itself; pass no attention_mask")
    # Under autocast the rotary embedding returns fp32 q and k beside a half-precision v: attend in v's dtype.
    q, k, v = (x[0].transpose(0, 1).to(value.dtype) for x in (query, key, value))
    layer = module.layer_idx
    method = _dense_attention if sb_context.config.backend == "dense" else _sparse_attention

    def attend(q, k, v):
        return method(q, k, v, layer, sb_context, scaling)

    timer = sb_context.timer
    out = attend(q, k, v) if timer is None else timer.timed(layer, attend, q, k, v)
    stats = sb_context.stats.get(layer)
    if sb_context.measures_recall and stats is not None and stats.recall is None:
        measurement = sb_context.measurement_timer
        if measurement is not None:
            measurement.start(("recall", layer))
        _measure_recall(q, k, layer, sb_context, stats, scaling)
        if measurement is not None:
            measurement.stop(("recall", layer))
    return out.unsqueeze(0), None


#: Share of the base budget's tiles that the price probes keep: a straggler's cut (the least estimated mass
#: across the layer goes first) and a fast rank's raise with every candidate allowed (tau 1, as DST raises where
#: tau0 + p >= 1; where it is lower the probe prices a raise more freely than DST makes it). Sizes of DST's
#: moves in the deferred step of 32 emulated ranks, on average: cuts to 52-65% of the base density, raises to
#: 1.8-2.3x (docs/RESULTS.md, tenth pass). Recall is concave in density, so a unit cut costs more the deeper
#: the cut: the cut probe sits at the deep end of DST's cuts (a probe at 70% underpriced them).
PROBE_CUT, PROBE_RAISE = 0.55, 2.0


def price_probes(base: LayerBudget) -> tuple[LayerBudget, LayerBudget]:
    """The moves of the base budget ``base`` whose exact recall a measured layer prices on every step, so that
    DST's adaptive anchor knows what density costs and buys before its first move (``LayerStats.probe_moves``)."""
    return replace(base, density_scale=PROBE_CUT), LayerBudget(1.0, None, PROBE_RAISE)


def _measure_recall(q, k, layer: int, ctx: AttentionContext, stats: LayerStats, scale: float | None) -> None:
    """The layer's exact recall at the budget in use, the base budget and its price probes, on the same rows
    (one softmax)."""
    from sparsebalance_pl.kernels import attention_recall

    selection = ctx.selections.pop(layer)
    base = selection.base_stats
    own = base is selection.stats  # the budget in use is the base one: its mask is measured once
    probes = [base.under(budget) for budget in price_probes((ctx.base_budgets or ctx.budgets)[layer])]
    masks = [selection.mask] + ([] if own else [base.mask()]) + [probe.mask() for probe in probes]
    recall = attention_recall(q.detach(), k.detach(), torch.stack(masks), ctx.cu_seqlens,
                              block_size=ctx.config.block_size, scale=scale, num_rows=ctx.recall_rows)
    stats.recall, stats.base_recall = recall[0], recall[0 if own else 1]
    base_density = base.mean_density()
    moves = [(probe.mean_density() - base_density, probe_recall - stats.base_recall)
             for probe, probe_recall in zip(probes, recall[len(masks) - len(probes):])]
    stats.probe_moves = torch.stack([torch.stack(move) for move in moves])


AttentionInterface.register(ATTN_IMPLEMENTATION, sparsebalance_attention)
