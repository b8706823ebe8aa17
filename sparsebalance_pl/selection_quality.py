"""How well block selection keeps a real model's attention: density, exact recall over every query row, the
selection's own recall estimate, and the next-token loss against dense attention on the same held-out text.

Training measures recall on a few sampled rows; a study of the selection itself needs it over every row, on the
activations the sparse model itself produces (each layer sees the earlier layers' sparse outputs, as in
training). So each layer's output here is the exact softmax restricted to the kept tiles (what
``block_sparse_attention`` computes), evaluated with the exact recall in one pass over the stream's rows, through
an attention implementation registered with transformers (``IMPLEMENTATION``): build the model with it
(``ModelConfig.build(IMPLEMENTATION)``) and run it with ``stream_loss``.

Streams: documents of a held-out split in a seeded order, packed one after another into streams of exactly the
length; the document that crosses a stream's end is cut there (its remainder dropped), so documents keep their
real lengths otherwise.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AttentionInterface

from sparsebalance_pl.attention import varlen_causal_attention
from sparsebalance_pl.errors import ConfigError, DataError
from sparsebalance_pl.kernels.layout import token_doc_ids
from sparsebalance_pl.kernels.selection import SELECTION_OPTIONS, rank_blocks, selection_options
from sparsebalance_pl.loss import chunked_cross_entropy_sum
from sparsebalance_pl.variants import parse_variant

IMPLEMENTATION = "selection_quality"
ROWS_PER_CHUNK = 256
"""Query rows per chunk of the exact pass: bounds its memory to chunk x stream scores per head (a multiple of
every block size used, so a chunk holds whole query blocks)."""
RANK_KEYS = ("stride", "sink_blocks", "local_blocks", "recall_probes", "per_head_tau", "estimate")
"""A selection variant's settings that go to ``rank_blocks``."""
BUDGET_KEYS = ("max_density", "tau", "late_tau", "late_from")
"""A selection variant's settings of its budget."""


@dataclass
class SelectionVariant:
    """A selection setting to measure: ``rank_blocks`` options and a budget. ``tau`` replaces the run's tau;
    layers from ``late_from`` on use ``late_tau`` instead (a per-layer ``LayerBudget.tau``, as
    ``SparseCausalLM.base_budgets`` can hold)."""

    name: str
    rank_kwargs: dict = field(default_factory=dict)
    max_density: float | None = None
    tau: float | None = None
    late_tau: float | None = None
    late_from: int | None = None

    @classmethod
    def parse(cls, spec: str, option: str = "--variants") -> SelectionVariant:
        """``name`` or ``name:key=value,...`` (``RANK_KEYS`` and ``BUDGET_KEYS``), checked by the kernels' own
        rules before any model is loaded; a bad one raises ``ConfigError`` naming it."""
        name, settings = parse_variant(spec, option)
        variant = cls(name)
        for key, value in settings.items():
            if key in RANK_KEYS:
                variant.rank_kwargs[key] = value
            elif key in BUDGET_KEYS:
                setattr(variant, key, value)
            else:
                raise ConfigError(f"{option} {spec!r}: unknown key {key!r}")
        if (variant.late_tau is None) != (variant.late_from is None):
            raise ConfigError(f"{option} {spec!r}: late_tau and late_from go together")
        try:
            selection_options(**{k: v for k, v in variant.rank_kwargs.items() if k in SELECTION_OPTIONS})
        except ValueError as err:
            raise ConfigError(f"{option} {spec!r}: {err}") from None
        return variant

    def layer_tau(self, layer: int, tau: float) -> float:
        """The tau of ``layer`` when the run's tau is ``tau``."""
        if self.late_from is not None and layer >= self.late_from:
            return self.late_tau
        return self.tau if self.tau is not None else tau

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.rank_kwargs.items()]
        parts += [f"{k}={getattr(self, k)}" for k in BUDGET_KEYS if getattr(self, k) is not None]
        return ", ".join(parts) or "default"


@dataclass
class QualityRun:
    """What the attention implementation needs for one forward of a stream, and what it records per layer.

    Args:
        cu_seqlens: the stream's document boundaries.
        block_size: tokens per block.
        variant: the selection to measure; None attends densely.
        tau: the run's recall target (``SelectionVariant.layer_tau``).
        layers: filled per layer: density, estimated and exact recall (mean and per head).
    """

    cu_seqlens: torch.Tensor
    block_size: int
    variant: SelectionVariant | None
    tau: float
    layers: dict = field(default_factory=dict)


def masked_attention(q, k, v, mask, cu_seqlens, block_size, scale):
    """(output [T, Hq, D], exact recall [Hq, T]) of softmax attention restricted to the kept tiles ``mask``
    [Hq, nB, nB], causal within documents; every row computed exactly."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    doc = token_doc_ids(cu_seqlens, num_tokens)
    kr = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, T, D]
    vr = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    qh = q.float().transpose(0, 1)
    out = torch.empty(num_q_heads, num_tokens, head_dim)
    recall = torch.empty(num_q_heads, num_tokens)
    positions = torch.arange(num_tokens)
    for r0 in range(0, num_tokens, ROWS_PER_CHUNK):
        r1 = min(num_tokens, r0 + ROWS_PER_CHUNK)
        rows = positions[r0:r1]
        scores = qh[:, r0:r1] @ kr[:, :r1].transpose(1, 2) * scale  # [Hq, R, r1]
        allowed = (positions[None, :r1] <= rows[:, None]) & (doc[None, :r1] == doc[rows, None])
        probs = torch.softmax(scores.masked_fill_(~allowed, float("-inf")), dim=-1)
        keep = mask[:, rows // block_size][:, :, positions[:r1] // block_size]  # [Hq, R, r1]
        probs = probs * keep
        kept = probs.sum(dim=-1)
        recall[:, r0:r1] = kept
        out[:, r0:r1] = (probs @ vr[:, :r1]) / kept[..., None]
    return out.transpose(0, 1).to(q.dtype), recall


def _quality_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, quality_run=None,
                       **kwargs):
    """The attention implementation: dense, or the variant's selection with exact recall (module docstring)."""
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    run: QualityRun = quality_run
    if run.variant is None:
        return varlen_causal_attention(q, k, v, run.cu_seqlens, scaling).unsqueeze(0), None
    variant = run.variant
    ranking = rank_blocks(q, k, run.cu_seqlens, block_size=run.block_size, scale=scaling, backend="torch",
                          **variant.rank_kwargs)
    tau = variant.layer_tau(module.layer_idx, run.tau)
    mask, stats = ranking.select(tau, variant.max_density)
    out, recall = masked_attention(q, k, v, mask, run.cu_seqlens, run.block_size, scaling)
    run.layers[module.layer_idx] = {
        "density": float(stats.mean_density()),
        "estimated_recall": float(stats.mean_kept_mass()),
        "exact_recall": float(recall.mean()),
        "exact_recall_per_head": recall.mean(dim=1).tolist(),
    }
    return out.unsqueeze(0), None


AttentionInterface.register(IMPLEMENTATION, _quality_attention)


def load_documents(data_dir: str | Path, split: str) -> list[np.ndarray]:
    """Every document of a built corpus's ``split``, as token arrays."""
    import litdata

    dataset = litdata.StreamingDataset(str(Path(data_dir) / split))
    return [np.asarray(dataset[i]["tokens"], dtype=np.int64) for i in range(len(dataset))]


def pack_streams(docs: list[np.ndarray], length: int, count: int, seed: int) -> list[dict]:
    """``count`` streams of exactly ``length`` tokens from the documents in a seeded order (module docstring);
    ``DataError`` when the documents hold too few tokens."""
    order = np.random.default_rng(seed).permutation(len(docs))
    streams, pieces, used = [], [], 0
    for i in order:
        doc = docs[i]
        if len(doc) < 2:
            continue
        take = doc[: length - used]
        pieces.append(take)
        used += len(take)
        if used == length:
            streams.append(_stream(pieces))
            pieces, used = [], 0
            if len(streams) == count:
                break
    if len(streams) < count:
        raise DataError(f"only {len(streams)} streams of {length} tokens from {len(docs)} held-out documents")
    return streams


def _stream(pieces: list[np.ndarray]) -> dict:
    lengths = [len(p) for p in pieces]
    input_ids = torch.from_numpy(np.concatenate(pieces))
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    targets = torch.cat([torch.cat([torch.from_numpy(p[1:]), torch.tensor([-100])]) for p in pieces])
    cu = torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32)
    return {"input_ids": input_ids, "position_ids": position_ids, "targets": targets, "cu_seqlens": cu,
            "doc_lengths": lengths}


@torch.no_grad()
def stream_loss(model, stream: dict, run: QualityRun) -> tuple[float, int]:
    """(summed next-token loss, loss-bearing tokens) of ``model`` (built with ``IMPLEMENTATION``) on a stream;
    ``run`` collects the layers' figures."""
    hidden = model.model(input_ids=stream["input_ids"][None], position_ids=stream["position_ids"][None],
                         use_cache=False, quality_run=run).last_hidden_state
    loss_sum, count = chunked_cross_entropy_sum(hidden[0], model.lm_head.weight, stream["targets"], 1024)
    return float(loss_sum), int(count)


def dense_losses(model, streams: list[dict], block_size: int) -> Iterator[tuple[float, int]]:
    """Each stream's ``stream_loss`` with dense attention, one at a time (the caller may report progress)."""
    for s in streams:
        yield stream_loss(model, s, QualityRun(s["cu_seqlens"], block_size, None, 1.0))


def sparse_pass(model, streams: list[dict], variant: SelectionVariant, tau: float,
                block_size: int) -> Iterator[dict]:
    """Each stream's loss, tokens, per-layer figures and seconds with ``variant``'s selection at ``tau``, one
    stream at a time; ``summarise`` sums them up."""
    for s in streams:
        run = QualityRun(s["cu_seqlens"], block_size, variant, tau)
        start = time.perf_counter()
        loss_sum, tokens = stream_loss(model, s, run)
        yield {"loss_sum": loss_sum, "tokens": tokens, "layers": run.layers, "seconds": time.perf_counter() - start}


def summarise(variant: SelectionVariant, per_stream: list[dict], dense: list[tuple[float, int]],
              num_layers: int) -> dict:
    """A variant's figures over the streams: per layer the means over streams, overall the means over layers;
    the loss gap of the token-weighted loss over all streams, with its median over streams beside it."""
    layers = []
    for layer in range(num_layers):
        entry = {key: statistics.fmean(s["layers"][layer][key] for s in per_stream)
                 for key in ("density", "estimated_recall", "exact_recall")}
        entry["estimate_error"] = entry["estimated_recall"] - entry["exact_recall"]
        layers.append(entry)
    loss = sum(s["loss_sum"] for s in per_stream) / sum(s["tokens"] for s in per_stream)
    dense_loss = sum(d[0] for d in dense) / sum(d[1] for d in dense)
    gaps = [(s["loss_sum"] / s["tokens"]) / (d[0] / d[1]) - 1 for s, d in zip(per_stream, dense)]
    errors = [abs(x["estimate_error"]) for x in layers]
    return {
        "variant": variant.name,
        "settings": variant.describe(),
        "density": statistics.fmean(x["density"] for x in layers),
        "exact_recall": statistics.fmean(x["exact_recall"] for x in layers),
        "estimated_recall": statistics.fmean(x["estimated_recall"] for x in layers),
        "min_layer_exact_recall": min(x["exact_recall"] for x in layers),
        "max_layer_estimate_error": max(errors),
        "layers_estimate_within_0.02": sum(e <= 0.02 for e in errors),
        "loss": loss,
        "dense_loss": dense_loss,
        "loss_gap": loss / dense_loss - 1,
        "loss_gap_median_stream": statistics.median(gaps),
        "seconds_per_stream": statistics.fmean(s["seconds"] for s in per_stream),
        "layers": layers,
    }
