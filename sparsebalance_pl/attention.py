"""Packed-sequence attention for Hugging Face Qwen2, plugged in through transformers' AttentionInterface.

Qwen2 calls the registered function with q, k, v as [1, H, T, D] (KV heads not repeated) and no mask, so
the function applies causality and document boundaries itself from the ``AttentionContext`` that the
LightningModule passes as a model keyword argument (``sb_context``). Two backends:

- ``dense``: exact causal attention within each document (PyTorch SDPA per document);
- ``sparse``: XAttention-style block selection then block-sparse attention (``sparsebalance_pl.kernels``).

The context also carries the per-layer budgets (moved by dynamic sparsity tuning), caches the chosen masks
so an activation-checkpointing recomputation reuses exactly the same mask, collects per-layer density and
estimated recall for logging, the density each document would have had at the base budgets (from the same
ranking, for predicting the next batches' cost), and times the attention calls, forward and backward: they
are free of collectives, unlike whole steps under FSDP or DDP.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from sparsebalance_pl.errors import ConfigError

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
        recall_rows: measure each layer's exact recall on this many sampled query rows per training
            micro-batch (0: off; the estimated recall of the selection is always reported).
    """

    backend: AttentionBackend = "sparse"
    block_size: int = 64
    tau: float = 0.9
    stride: int = 16
    max_density: float | None = None
    kernel_backend: KernelBackend = "auto"
    recall_rows: int = 0

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


def _is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


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


@dataclass
class LayerStats:
    """What one layer's selection kept, as tensors (no host sync inside the forward).

    ``base_document_density`` [docs]: each document's kept fraction of causal tiles had the layer used its
    base budget, counted from the same ranking (query blocks count for the document of their first token).
    """

    density: torch.Tensor
    estimated_recall: torch.Tensor
    base_document_density: torch.Tensor
    recall: torch.Tensor | None = None


class AttentionTimer:
    """Seconds spent in the attention calls of one micro-batch, forward and backward, free of collectives.

    Each call is bracketed in the forward directly and in the backward by identity autograd nodes on its
    output (backward starts) and on its inputs (backward done); autograd runs a layer's attention nodes
    before any node created earlier in the forward. On CUDA the brackets are events on the stream, read by
    ``seconds()`` after the step, so timing never synchronises the device inside the layers; on the CPU
    ``perf_counter``.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._open: dict[tuple[str, int], object] = {}
        self._cpu_seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _now(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, key: tuple[str, int]) -> None:
        self._open[key] = self._now()

    def stop(self, key: tuple[str, int]) -> None:
        begun = self._open.pop(key, None)
        if begun is None:
            return
        if self.cuda:
            self._events.append((begun, self._now()))
        else:
            self._cpu_seconds += time.perf_counter() - begun

    def seconds(self) -> float:
        """Total so far; on CUDA waits for the last recorded event (call it after the step)."""
        if not self._events:
            return self._cpu_seconds
        self._events[-1][1].synchronize()
        return self._cpu_seconds + sum(a.elapsed_time(b) for a, b in self._events) / 1000.0

    def timed(self, layer: int, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        """``fn(*inputs)`` with its forward and (when inputs need gradients) its backward timed."""
        track_backward = torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
        if track_backward:
            inputs = _BackwardMark.apply(lambda: self.stop(("backward", layer)), *inputs)
        self.start(("forward", layer))
        out = fn(*inputs)
        self.stop(("forward", layer))
        if track_backward:
            (out,) = _BackwardMark.apply(lambda: self.start(("backward", layer)), out)
        return out


class _BackwardMark(torch.autograd.Function):
    """Identity whose backward calls ``hook`` once all gradients of its outputs have arrived."""

    @staticmethod
    def forward(ctx, hook: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hook = hook
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:
        ctx.hook()
        return (None, *grads)


@dataclass
class AttentionContext:
    """Per-forward state of the attention function, created by the module for each micro-batch.

    ``budgets`` are those in use (moved by dynamic sparsity tuning); ``base_budgets`` those against which
    ``LayerStats.base_document_density`` is counted (the configured ones; default: ``budgets``). With
    ``recall_rows`` > 0 each layer's exact recall is measured on that many sampled query rows, outside the
    timed region (costs rows x T per head).
    """

    cu_seqlens: torch.Tensor
    config: AttentionConfig
    budgets: list[LayerBudget]
    base_budgets: list[LayerBudget] | None = None
    timer: AttentionTimer | None = None
    recall_rows: int = 0
    masks: dict[int, torch.Tensor] = field(default_factory=dict)
    stats: dict[int, LayerStats] = field(default_factory=dict)

    def mean_density(self) -> float | None:
        return _mean_of(s.density for s in self.stats.values())

    def mean_estimated_recall(self) -> float | None:
        return _mean_of(s.estimated_recall for s in self.stats.values())

    def mean_recall(self) -> float | None:
        return _mean_of(s.recall for s in self.stats.values() if s.recall is not None)


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


def _sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, ctx: AttentionContext, scale: float | None
) -> torch.Tensor:
    from sparsebalance_pl.kernels import block_sparse_attention, rank_blocks

    cfg = ctx.config
    mask = ctx.masks.get(layer)
    if mask is None:
        budget, base = ctx.budgets[layer], (ctx.base_budgets or ctx.budgets)[layer]
        with torch.no_grad():
            ranking = rank_blocks(q.detach(), k.detach(), ctx.cu_seqlens, block_size=cfg.block_size, stride=cfg.stride)
            # The base budget's kept blocks size the tile scale and give the base densities; when the budget
            # is the base one (static, evaluation), the selection's own counts are those.
            base_kept = None if budget == base else ranking.kept_at([base.tau], base.max_density)[..., 0]
            max_tiles = None if budget.density_scale is None else (budget.density_scale * base_kept.sum()).floor()
            mask, stats = ranking.select(budget.tau, budget.max_density, max_tiles)
            if base_kept is None:
                base_kept = stats.kept
        ctx.masks[layer] = mask
        ctx.stats[layer] = LayerStats(
            density=stats.mean_density(),
            estimated_recall=stats.mean_kept_mass(),
            base_document_density=document_density(
                base_kept, stats.candidates, ctx.cu_seqlens, q.shape[0], cfg.block_size
            ),
        )
    return block_sparse_attention(
        q, k, v, mask, ctx.cu_seqlens, block_size=cfg.block_size, scale=scale, backend=cfg.kernel_backend
    )


def document_density(
    kept_rows: torch.Tensor, candidates: torch.Tensor, cu_seqlens: torch.Tensor, num_tokens: int, block_size: int
) -> torch.Tensor:
    """[docs] kept / causal tiles of each document, from a selection's kept blocks per row ``kept_rows``
    [Hq, nB] and candidate blocks per query block ``candidates`` [nB] (``BlockRanking``).

    A query block shared by two documents counts for the one it starts in; exact for block-aligned documents.
    A document starting no block (shorter than one, inside another's) is dense: it sees only forced blocks.
    """
    from sparsebalance_pl.kernels.layout import token_doc_ids

    kept = kept_rows.sum(0).float()  # [nB]
    doc_ids = token_doc_ids(cu_seqlens.to(kept.device), num_tokens)
    block_doc = doc_ids[::block_size]
    num_docs = len(cu_seqlens) - 1
    kept_per_doc = kept.new_zeros(num_docs).index_add_(0, block_doc, kept)
    covered = kept.new_zeros(num_docs).index_add_(0, block_doc, candidates.float())
    density = kept_per_doc / (covered * kept_rows.shape[0]).clamp(min=1)
    return torch.where(covered > 0, density.clamp(max=1.0), torch.ones_like(density))


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
    if sb_context.config.backend == "dense":
        def attend(q, k, v):
            return varlen_causal_attention(q, k, v, sb_context.cu_seqlens, scaling)
    else:
        def attend(q, k, v):
            return _sparse_attention(q, k, v, layer, sb_context, scaling)
    timer = sb_context.timer
    out = attend(q, k, v) if timer is None else timer.timed(layer, attend, q, k, v)
    stats = sb_context.stats.get(layer)
    if sb_context.recall_rows > 0 and stats is not None and stats.recall is None:
        from sparsebalance_pl.kernels import attention_recall

        stats.recall = attention_recall(
            q.detach(), k.detach(), sb_context.masks[layer], sb_context.cu_seqlens,
            block_size=sb_context.config.block_size, scale=scaling, num_rows=sb_context.recall_rows,
        )
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, sparsebalance_attention)
