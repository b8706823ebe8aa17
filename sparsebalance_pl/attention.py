"""Sparse attention for a whole model: its settings, the object every attention layer calls, and its plug-in
for Hugging Face models.

``SparseAttention`` is everything SparseBalance needs from a model. Each attention layer calls
``attend(layer, q, k, v, cu_seqlens)`` on one packed stream; the object applies causality and document
boundaries, selects blocks under the layer's budget (``LayerBudget``: moved by dynamic sparsity tuning), runs the
block-sparse kernels, times the calls forward and backward (they hold no collective, unlike whole steps under
FSDP or DDP), keeps the masks so that an activation-checkpointing recomputation reuses them, and collects what
each layer kept as tensors (no host synchronisation inside the forward). After the backward, ``observe()`` turns
the micro-batch into one ``SparsityReport`` and teaches the run's ``CostModel``, which the object owns and which
sparsity-aware batching and DST predict with. Two backends:

- ``dense``: exact causal attention within each document (PyTorch SDPA per document);
- ``sparse``: XAttention-style block selection then block-sparse attention (``sparsebalance_pl.kernels``).

With a context-parallel group (``begin(..., context_parallel=...)``) q, k and v are this rank's block-striped rows
of a stream the group shares: selection scores against the whole stream's keys with one group-wide threshold,
and attention runs the ring over the group (dense attention: the ring with every causal block).

transformers calls ``sparsebalance_attention`` (registered as ``ATTN_IMPLEMENTATION``) with q, k, v as [1, H, T, D],
KV heads not repeated and no mask, in every family that routes its attention through ``AttentionInterface``; the
model is called with the keyword ``sparse_attention`` (``PackedCausalLM`` does this).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from sparsebalance_pl.context_parallel import ContextParallel
from sparsebalance_pl.cost import CostModel, DensityEstimator, SparsityReport, StepObservation, StepRecord, observe_step
from sparsebalance_pl.cost.latency import LatencyModel, cost_dims
from sparsebalance_pl.distributed import gather_objects
from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.kernels import PackedDocuments
from sparsebalance_pl.kernels.selection import (
    SELECTION_OPTIONS, BudgetedSelection, LayerBudget, selection_options, tile_density,
)
from sparsebalance_pl.timing import AttentionTimer

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AttentionConfig",
    "MicroBatch",
    "SparseAttention",
    "SparsityTunable",
    "price_probes",
    "sparsebalance_attention",
    "varlen_causal_attention",
]

ATTN_IMPLEMENTATION = "sparsebalance"
AttentionBackend = Literal["dense", "sparse"]
KernelBackend = Literal["auto", "torch", "triton", "flex"]


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
        kernel_backend: ``auto`` (Triton on CUDA GPUs from Ampere on, torch otherwise), ``torch``, ``triton`` or
            ``flex`` (PyTorch's FlexAttention for the attention, Triton for the selection; trains on CUDA only, and
            context-parallel streams run the ring on the ``auto`` kernels).
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
        if self.kernel_backend not in ("auto", "torch", "triton", "flex"):
            raise ConfigError(
                f"attention.kernel_backend={self.kernel_backend!r} is unknown; allowed: 'auto', 'torch', 'triton', "
                "'flex'"
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
    """What one layer's selection kept: the tensors the selection made, kept as they are, so that the forward spends
    no launch and no host read on statistics; ``layer_means`` reduces every layer's at once after the backward.

    ``kept`` and ``kept_mass`` [Hq, rows]: each row's kept blocks and estimated kept share of its attention mass at
    the budget in use, ``base_kept`` and ``base_kept_mass`` the same at the base budget, from the same ranking;
    ``candidates`` [rows]: each row's candidate blocks; ``base_document_tiles`` [2, docs]: each document's kept and
    candidate tiles at the base budget (query blocks count for the document of their first token). ``recall`` and
    ``base_recall``: the exact recalls on sampled rows, when measured, and then ``probe_moves`` [2, 2]: (density,
    exact recall) of each of ``price_probes`` minus the base budget's, on those rows.
    """

    kept: torch.Tensor
    kept_mass: torch.Tensor
    base_kept: torch.Tensor
    base_kept_mass: torch.Tensor
    candidates: torch.Tensor
    base_document_tiles: torch.Tensor
    recall: torch.Tensor | None = None
    base_recall: torch.Tensor | None = None
    probe_moves: torch.Tensor | None = None

    @staticmethod
    def of(selection: BudgetedSelection) -> "LayerStats":
        stats, base = selection.stats, selection.base_stats
        return LayerStats(stats.kept, stats.kept_mass, base.kept, base.kept_mass, stats.candidates,
                          selection.base_document_tiles)


def layer_means(layers: list[LayerStats]) -> dict[str, torch.Tensor]:
    """[L] each layer's density (kept over candidate tiles) and mean estimated recall, at the budget in use and at
    the base budget, and [docs] each document's base density averaged over the layers: a few ops for all layers."""

    def stacked(name: str) -> torch.Tensor:
        return torch.stack([getattr(stats, name) for stats in layers])

    candidate_tiles = stacked("candidates").sum(-1) * layers[0].kept.shape[0]
    return {
        "density": stacked("kept").sum((1, 2)) / candidate_tiles,
        "estimated_recall": stacked("kept_mass").float().mean((1, 2)),
        "base_density": stacked("base_kept").sum((1, 2)) / candidate_tiles,
        "base_estimated_recall": stacked("base_kept_mass").float().mean((1, 2)),
        "base_document_density": tile_density(stacked("base_document_tiles")).mean(0),
    }


@dataclass
class MicroBatch:
    """The attention's state for one micro-batch's forward and backward (``SparseAttention.begin`` makes it).

    ``budgets`` are those in use; ``base_budgets`` those against which ``LayerStats.base_document_tiles`` are
    counted. With ``recall_rows`` > 0 each layer's exact recall is measured on about that many sampled query rows,
    outside the timed region (costs rows x T per head; not under context parallelism, where a rank lacks the
    other ranks' keys), at the budget in use and, on the same rows, at the base budget and at its
    ``price_probes`` (``selections`` holds the layer's selection until then, so the other masks are built outside
    the timed region; ``measurement_timer`` times it, so that a rank's time can leave out work a run without
    ``recall_rows`` would not do). ``context_parallel``: the group sharing the stream, whose ranks must hold
    equal budgets; its ``masks`` then hold only this rank's striped rows, and ``ring_timer`` times the ring's
    waits (a part of ``timer``'s time). ``observed``: the cost model has learned from it.
    """

    cu_seqlens: torch.Tensor
    budgets: list[LayerBudget]
    base_budgets: list[LayerBudget]
    timer: AttentionTimer
    measurement_timer: AttentionTimer
    ring_timer: AttentionTimer | None = None
    recall_rows: int = 0
    context_parallel: ContextParallel = field(default_factory=ContextParallel)
    masks: dict[int, torch.Tensor] = field(default_factory=dict)
    selections: dict[int, BudgetedSelection] = field(default_factory=dict)
    stats: dict[int, LayerStats] = field(default_factory=dict)
    observed: bool = False
    documents: PackedDocuments | None = field(default=None, init=False, repr=False)  # the first layer knows T

    def shared_documents(self, num_tokens: int, block_size: int) -> PackedDocuments:
        """The stream's ``PackedDocuments``, made at the first layer that asks and shared by the others (whose
        selection and attention refuse it if their length or block size differ)."""
        if self.documents is None:
            self.documents = PackedDocuments(self.cu_seqlens, num_tokens, block_size)
        return self.documents

    @property
    def measures_recall(self) -> bool:
        return self.recall_rows > 0 and not self.context_parallel.active

    def mean_density(self) -> float | None:
        return float(layer_means(list(self.stats.values()))["density"].mean()) if self.stats else None

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


class SparseAttention:
    """Sparse attention for every attention layer of one model, and all that SparseBalance learns from it.

    A model calls ``attend(layer, q, k, v, cu_seqlens)`` in each attention layer; a Lightning module holding the
    object as ``sparse_attention`` (``SparsityTunable``) then works with ``DynamicSparsityTuning``, which moves
    ``budgets`` before every training micro-batch and lets the cost model learn after every backward
    (``observe``), and with ``SparsityAwareSampler(..., cost_model=sparse_attention.cost_model)``. A micro-batch
    begins at the first ``attend`` with another ``cu_seqlens`` tensor than the last one's, or after ``observe``
    (or at ``begin``): pass the same tensor to every layer of a micro-batch.

    Args:
        dims: the dimensions the cost model keys on, a mapping or ``sparsebalance_pl.model.ModelDims``:
            ``num_layers`` (attention layers), ``hidden_size``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
            ``intermediate_size`` and ``vocab_size``. The analytic prior counts a gated MLP of three
            ``hidden_size x intermediate_size`` matrices (SwiGLU, as Llama and Qwen); for a two-matrix MLP of width
            w pass ``2 * w / 3``. A profiled table (``profile``) measures the module instead.
        config: the attention's backend, block size, budget and selection options.
        latency: the latency model: a ``LatencyModel``, the path of a table profiled for these ``dims`` and
            settings (``profile``, ``main.py profile``), or None for the analytic FLOP prior, which DST trusts
            only once the cost model's measured error is small (``DynamicSparsityTuning``).
    """

    def __init__(
        self,
        dims: Any,
        config: AttentionConfig | None = None,
        latency: LatencyModel | str | Path | None = None,
    ) -> None:
        self.config = config or AttentionConfig()
        self.dims = dims
        self.num_layers = cost_dims(dims)["num_layers"]
        self.base_budgets = [LayerBudget(self.config.tau, self.config.max_density) for _ in range(self.num_layers)]
        self.budgets = [replace(b) for b in self.base_budgets]
        sparse = self.config.backend == "sparse"
        density = DensityEstimator(block_size=self.config.block_size) if sparse else None
        self.cost_model = CostModel(self._latency_model(latency), density)
        self.micro_batch: MicroBatch | None = None

    def _latency_model(self, latency: LatencyModel | str | Path | None) -> LatencyModel:
        cfg = self.config
        settings = dict(block_size=cfg.block_size, stride=cfg.stride, selection=cfg.selection_options())
        if latency is None:
            return LatencyModel.analytic(self.dims, **settings)
        if isinstance(latency, LatencyModel):
            return latency
        return LatencyModel.from_file(latency, self.dims, **settings)

    # --------------------------------------------------------------------------------------- a micro-batch
    def begin(
        self,
        cu_seqlens: torch.Tensor,
        *,
        training: bool | None = None,
        measure_recall: bool = False,
        context_parallel: ContextParallel | None = None,
    ) -> MicroBatch:
        """Start a micro-batch: a packed stream of documents bounded by ``cu_seqlens`` (int32, from 0 to T).

        ``training`` (default: whether autograd records) attends at ``budgets``, else at the base budgets (the
        model is evaluated, not DST); recall is measured (``recall_rows``) in training, and outside it where
        ``measure_recall``. ``context_parallel``: the group sharing a block-striped stream; its ranks agree on one
        budget, that of its member keeping the fewest tiles (the slowest sets the group's time): a collective.
        """
        training = torch.is_grad_enabled() if training is None else training
        cp = context_parallel or ContextParallel()
        budgets = self.budgets if training else self.base_budgets
        if cp.active and training:
            budgets = _group_budgets(budgets, cp)
        device = cu_seqlens.device
        self.micro_batch = MicroBatch(
            cu_seqlens=cu_seqlens,
            budgets=budgets,
            base_budgets=self.base_budgets,
            timer=AttentionTimer(device),
            measurement_timer=AttentionTimer(device),
            ring_timer=AttentionTimer(device) if cp.active else None,
            recall_rows=self.config.recall_rows if training or measure_recall else 0,
            context_parallel=cp,
        )
        return self.micro_batch

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        *,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Causal attention within each document of one packed stream, sparse under ``layer``'s budget: q [T, Hq, D],
        k and v [T, Hkv, D] (KV heads not repeated), ``cu_seqlens`` int32 [docs + 1]; returns [T, Hq, D]."""
        batch = self.micro_batch
        if batch is None or batch.observed or batch.cu_seqlens is not cu_seqlens:
            batch = self.begin(cu_seqlens)
        method = _dense_attention if self.config.backend == "dense" else _sparse_attention

        def run(q, k, v):
            return method(q, k, v, layer, batch, self.config, scale)

        out = batch.timer.timed(layer, run, q, k, v)
        stats = batch.stats.get(layer)
        if batch.measures_recall and stats is not None and stats.recall is None:
            batch.measurement_timer.start(("recall", layer))
            _measure_recall(q, k, layer, batch, self.config, stats, scale)
            batch.measurement_timer.stop(("recall", layer))
        return out

    # --------------------------------------------------------------------------------- after the backward
    def report(self) -> SparsityReport:
        """What the micro-batch's attention did, as host numbers: densities, recall, attention time, ring waits and
        the time recall's measurement took (dense attention keeps every tile). Call it after the backward."""
        batch = self._done("report")
        docs = len(batch.cu_seqlens) - 1
        ring_seconds = 0.0 if batch.ring_timer is None else batch.ring_timer.seconds()
        if not batch.stats:
            dense = [1.0] * self.num_layers
            return SparsityReport(dense, dense, [1.0] * docs, batch.timer.seconds(), ring_seconds=ring_seconds)
        means = layer_means([batch.stats[i] for i in sorted(batch.stats)])
        values = iter(torch.cat([x.double() for x in means.values()]).tolist())  # one read back for all of them
        numbers = {name: list(itertools.islice(values, x.numel())) for name, x in means.items()}
        return SparsityReport(
            density=numbers["density"],
            estimated_recall=numbers["estimated_recall"],
            base_document_density=numbers["base_document_density"],
            attention_seconds=batch.timer.seconds(),
            recall=batch.mean_recall(),
            ring_seconds=ring_seconds,
            base_density=numbers["base_density"],
            base_estimated_recall=numbers["base_estimated_recall"],
            base_recall=batch.mean_base_recall(),
            probe_moves=batch.mean_probe_moves(),
            measurement_seconds=batch.measurement_timer.seconds(),
        )

    def record(self) -> StepRecord:
        """The micro-batch's documents, ``report`` and this rank's share of the documents' work (``1 / W`` of a
        stream shared by a context-parallel group of W)."""
        batch = self._done("record")
        lengths = torch.diff(batch.cu_seqlens).tolist()
        return StepRecord(lengths, self.report(), 1.0 / batch.context_parallel.size)

    def observe(self) -> StepObservation | None:
        """Teach the cost model this micro-batch on every rank: every rank's ``record`` is gathered (one all-gather
        of a few numbers each; call it on every rank after the backward). Once per micro-batch, whoever calls it
        first: later calls return the same observation until another micro-batch begins. None before any."""
        batch = self.micro_batch
        if batch is None:
            return None
        if not batch.observed:
            record = self.record()
            batch.observed = True
            observe_step(self.cost_model, record.lengths, record.report, share=record.share)
        return self.cost_model.last_step

    def _done(self, what: str) -> MicroBatch:
        if self.micro_batch is None:
            raise RuntimeError(f"SparseAttention.{what}() before any layer attended: call attend() in every layer")
        return self.micro_batch

    # --------------------------------------------------------------------------- what DST and SAB read
    def document_lengths(self, batch: Mapping[str, Any]) -> list[int]:
        """Token count of each document of a packed micro-batch, from its ``cu_seqlens`` (read before its forward)."""
        if not isinstance(batch, Mapping) or "cu_seqlens" not in batch:
            raise TypeError("SparseAttention reads a micro-batch's documents from batch['cu_seqlens'] (int32 "
                            "[docs + 1], from 0 to the stream's length); this batch has none")
        return torch.diff(batch["cu_seqlens"]).tolist()

    @staticmethod
    def stream_share(batch: Mapping[str, Any]) -> float:
        """The part of a micro-batch's documents this rank computes: ``1 / W`` of a stream a context-parallel group
        of W ranks shares (``batch["shared_stream"]``, as ``SparsityAwareSampler`` plans it), else 1."""
        return 1.0 / batch.get("shared_stream", 1)

    def profile(
        self,
        step: Callable[[list[int]], object],
        *,
        max_length: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        output: str | Path | None = None,
        **settings: Any,
    ) -> LatencyModel:
        """Measure this device's latency table for the module and use it from now on (saved to ``output``).

        ``step(lengths)`` runs the module's forward and backward on one micro-batch of documents of those lengths
        (the device synchronised after it on a GPU); ``max_length`` is the longest document the table must reach.
        Attention and selection are timed with the real kernels at these ``dims`` and this ``config`` on
        ``device`` in ``dtype``, the rest from the module's own steps
        (``sparsebalance_pl.cost.profiler.profile_module``, which takes ``settings``).
        """
        # imported here: the profiler builds on this module
        from sparsebalance_pl.cost.profiler import KernelSettings, profile_module

        kernels = KernelSettings.of(self.config, device, dtype)
        model = profile_module(self.dims, step, kernels, max_length=max_length, output=output, **settings)
        self.cost_model.latency = model
        return model


@runtime_checkable
class SparsityTunable(Protocol):
    """What ``DynamicSparsityTuning`` needs of a LightningModule: the ``SparseAttention`` its layers attend
    through."""

    sparse_attention: SparseAttention


def _group_budgets(budgets: list[LayerBudget], cp: ContextParallel) -> list[LayerBudget]:
    """One budget for the whole context-parallel group (its selection is collective and needs equal budgets):
    the budgets of the member keeping the fewest tiles (least mean ``density_scale``, then lowest mean tau),
    whose time sets the group's; the first such member on a tie."""
    members = gather_objects(budgets, group=cp.group)

    def tightness(member: list[LayerBudget]) -> tuple[float, float]:
        scales = [1.0 if b.density_scale is None else b.density_scale for b in member]
        return float(np.mean(scales)), float(np.mean([b.tau for b in member]))

    return min(members, key=tightness)


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


def _ring_attention(q, k, v, mask, layer: int, batch: MicroBatch, config: AttentionConfig, scale: float | None):
    from sparsebalance_pl.kernels import sparse_ring_attention

    cp = batch.context_parallel
    backend = "auto" if config.kernel_backend == "flex" else config.kernel_backend  # the ring has no flex kernels
    documents = batch.shared_documents(q.shape[0] * cp.size, config.block_size)
    return sparse_ring_attention(
        q, k, v, documents, block_size=config.block_size, group=cp.group, block_mask=mask,
        backend=backend, scale=scale, node_size=cp.node_size, label=f"layer {layer}",
        wait_timer=batch.ring_timer,
    )


def _dense_attention(q, k, v, layer: int, batch: MicroBatch, config: AttentionConfig, scale: float | None):
    if batch.context_parallel.active:
        return _ring_attention(q, k, v, None, layer, batch, config, scale)
    return varlen_causal_attention(q, k, v, batch.cu_seqlens, scale)


def _sparse_attention(q, k, v, layer: int, batch: MicroBatch, config: AttentionConfig, scale: float | None):
    from sparsebalance_pl.kernels import block_sparse_attention, select_with_budget, select_with_budget_striped
    from sparsebalance_pl.kernels.layout import striped_blocks

    cp = batch.context_parallel
    documents = batch.shared_documents(q.shape[0] * cp.size, config.block_size)  # the whole stream's
    mask = batch.masks.get(layer)
    if mask is None:  # an activation-checkpointing recomputation reuses the mask (and skips the collectives)
        settings = dict(block_size=config.block_size, stride=config.stride, scale=scale,
                        backend=config.kernel_backend, **config.selection_options())
        budget, base = batch.budgets[layer], batch.base_budgets[layer]
        if cp.active:
            selection = select_with_budget_striped(q.detach(), k.detach(), documents, budget, base, group=cp.group,
                                                   **settings)
        else:
            selection = select_with_budget(q.detach(), k.detach(), documents, budget, base, **settings)
        mask = selection.mask
        if batch.measures_recall:  # the base budget and its price probes are measured beside the budget in use
            batch.selections[layer] = selection
        if cp.active:  # the ring reads only this rank's rows: keep W times less for the recomputation
            mask = mask[:, striped_blocks(mask.shape[1], cp.size, cp.rank, mask.device)]
        batch.masks[layer] = mask
        batch.stats[layer] = LayerStats.of(selection)
    if cp.active:
        return _ring_attention(q, k, v, mask, layer, batch, config, scale)
    return block_sparse_attention(
        q, k, v, mask, documents, block_size=config.block_size, scale=scale, backend=config.kernel_backend
    )


#: Share of the base budget's tiles that the price probes keep: a straggler's cut (the least estimated mass
#: across the layer goes first) and a fast rank's raise with every candidate allowed (tau 1, as DST raises where
#: tau0 + p >= 1; where it is lower the probe prices a raise more freely than DST makes it). Recall is concave in
#: density, so a unit cut costs more the deeper the cut: the cut probe sits at the deep end of DST's cuts.
PROBE_CUT, PROBE_RAISE = 0.55, 2.0


def price_probes(base: LayerBudget) -> tuple[LayerBudget, LayerBudget]:
    """The moves of the base budget ``base`` whose exact recall a measured layer prices on every step, so that
    DST's adaptive anchor knows what density costs and buys before its first move (``LayerStats.probe_moves``)."""
    return replace(base, density_scale=PROBE_CUT), LayerBudget(1.0, None, PROBE_RAISE)


def _measure_recall(q, k, layer: int, batch: MicroBatch, config: AttentionConfig, stats: LayerStats,
                    scale: float | None) -> None:
    """The layer's exact recall at the budget in use, the base budget and its price probes, on the same rows
    (one softmax)."""
    from sparsebalance_pl.kernels import attention_recall

    selection = batch.selections.pop(layer)
    base = selection.base_stats
    own = base is selection.stats  # the budget in use is the base one: its mask is measured once
    probes = [base.under(budget) for budget in price_probes(batch.base_budgets[layer])]
    masks = [selection.mask] + ([] if own else [base.mask()]) + [probe.mask() for probe in probes]
    recall = attention_recall(q.detach(), k.detach(), torch.stack(masks), batch.cu_seqlens,
                              block_size=config.block_size, scale=scale, num_rows=batch.recall_rows)
    stats.recall, stats.base_recall = recall[0], recall[0 if own else 1]
    base_density = base.mean_density()
    moves = [(probe.mean_density() - base_density, probe_recall - stats.base_recall)
             for probe, probe_recall in zip(probes, recall[len(masks) - len(probes):])]
    stats.probe_moves = torch.stack([torch.stack(move) for move in moves])


#: What some families hand the attention function that the sparse attention cannot apply (checked at the
#: configuration too, ``sparsebalance_pl.model.check_architecture``): a logit soft-cap and attention sinks.
UNHONOURED_ARGUMENTS = ("softcap", "s_aux", "sinks")


def sparsebalance_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sparse_attention: SparseAttention | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered with transformers; returns [1, T, H, D] like Hugging Face's own backends."""
    name = type(module).__name__
    if sparse_attention is None:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} needs the model to be called with "
            "sparse_attention=SparseAttention(...), its micro-batch begun (SparseCausalLM does this)"
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed stream per call, got batch size {query.shape[0]}")
    if attention_mask is not None:
        raise ValueError("packed attention applies document and causal masking itself; pass no attention_mask")
    unhonoured = [arg for arg in UNHONOURED_ARGUMENTS if kwargs.get(arg) is not None] + ["dropout"] * (dropout > 0)
    if unhonoured:
        raise ValueError(f"{name} asks the attention for {', '.join(unhonoured)}, which the sparse attention "
                         "does not apply")
    # Under autocast the rotary embedding returns fp32 q and k beside a half-precision v: attend in v's dtype.
    q, k, v = (x[0].transpose(0, 1).to(value.dtype) for x in (query, key, value))
    batch = sparse_attention.micro_batch
    if batch is None:
        raise RuntimeError("call SparseAttention.begin(cu_seqlens) with the stream's document bounds before the model")
    return sparse_attention.attend(module.layer_idx, q, k, v, batch.cu_seqlens, scale=scaling).unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, sparsebalance_attention)
