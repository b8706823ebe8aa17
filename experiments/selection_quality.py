"""Selection quality on a real pretrained model and held-out real text (issue 17, item 4).

For each selection variant and each (length, tau), runs the model zero-shot over several packed streams of
held-out real documents with sparse attention chosen by that variant, and reports per layer and on average:

- density: kept tiles over candidate tiles (causal tiles within documents), as ``SelectionStats.mean_density``;
- exact recall: the exact share of each query's softmax mass (causal, within its document) that falls on the
  kept tiles, over **every** query token and head of the stream (no sampling), on the activations the sparse
  model itself produces (each layer sees the earlier layers' sparse outputs, as in training);
- estimated recall: what the selection believes it kept (``SelectionStats.mean_kept_mass``);
- loss: the mean next-token loss of the stream with that variant against the same streams with dense attention.

Each layer's sparse output is the exact softmax restricted to the kept tiles (what ``block_sparse_attention``
computes), evaluated together with the exact recall from one pass over the stream's rows. Streams: the held-out
(``val``) split of the corpus, documents in a seeded order, packed one after another into streams of exactly the
length; the document that crosses a stream's end is cut there (its remainder is dropped), so documents keep
their real lengths otherwise. Figures are means over streams (per-layer values are means over streams; the
"mean" row is the mean over layers); the loss gap is the relative difference of the token-weighted loss over
all streams, with its median over streams beside it.

    python benchmarks/selection_quality.py --lengths 4096 --taus 0.9 --streams 4 \\
        --variants base "s8:stride=8" --out outputs/selection_quality

A variant is ``name`` or ``name:key=value,key=value`` with keys passed to ``rank_blocks`` (``stride``,
``estimate``, ``sink_blocks``, ``local_blocks``, ``recall_probes``, ``per_head_tau``: ``SELECTION_OPTIONS``) or ``max_density``/``tau`` (``tau`` replaces
the --taus value), or ``late_from``/``late_tau``: layers from ``late_from`` on use ``late_tau`` instead (a
per-layer ``LayerBudget.tau``, as ``SparseCausalLM.base_budgets`` can hold; with ``per_head_tau`` it is a per-layer
recall target). ``base`` is the default selection.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from transformers import AttentionInterface

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from variant_spec import parse_variant  # noqa: E402
from sparsebalance_pl.attention import varlen_causal_attention  # noqa: E402
from sparsebalance_pl.kernels.layout import token_doc_ids  # noqa: E402
from sparsebalance_pl.kernels.selection import SELECTION_OPTIONS, rank_blocks, selection_options  # noqa: E402
from sparsebalance_pl.loss import chunked_cross_entropy_sum  # noqa: E402
from sparsebalance_pl.model import ModelConfig  # noqa: E402
from sparsebalance_pl.progress import LoggedProgress  # noqa: E402

IMPLEMENTATION = "selection_quality"
_ROWS = 256  # query rows per chunk of the exact pass (a multiple of every block size used)
_RANK_KEYS = ("stride", "sink_blocks", "local_blocks", "recall_probes", "per_head_tau", "estimate")  # rank_blocks
_FLOAT_KEYS = ("max_density", "tau", "late_tau")
_LAYER_KEYS = ("late_from",)


@dataclass
class Variant:
    name: str
    rank_kwargs: dict = field(default_factory=dict)
    max_density: float | None = None
    tau: float | None = None
    late_tau: float | None = None
    late_from: int | None = None

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        name, settings = parse_variant(spec, "--variants")
        variant = cls(name)
        for key, value in settings.items():
            if key in _RANK_KEYS:
                variant.rank_kwargs[key] = value
            elif key in _FLOAT_KEYS + _LAYER_KEYS:
                setattr(variant, key, value)
            else:
                raise SystemExit(f"--variants {spec!r}: unknown key {key!r}")
        if (variant.late_tau is None) != (variant.late_from is None):
            raise SystemExit(f"--variants {spec!r}: late_tau and late_from go together")
        try:  # the kernels' own checks, before the model is loaded
            selection_options(**{k: v for k, v in variant.rank_kwargs.items() if k in SELECTION_OPTIONS})
        except ValueError as err:
            raise SystemExit(f"--variants {spec!r}: {err}") from None
        return variant

    def layer_tau(self, layer: int, tau: float) -> float:
        """The tau of ``layer`` when the run's tau is ``tau``."""
        if self.late_from is not None and layer >= self.late_from:
            return self.late_tau
        return self.tau if self.tau is not None else tau

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.rank_kwargs.items()]
        parts += [f"{k}={getattr(self, k)}" for k in _FLOAT_KEYS + _LAYER_KEYS if getattr(self, k) is not None]
        return ", ".join(parts) or "default"


@dataclass
class Run:
    """What the attention function needs for one forward, and what it records per layer."""

    cu_seqlens: torch.Tensor
    block_size: int
    variant: Variant | None  # None: dense
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
    for r0 in range(0, num_tokens, _ROWS):
        r1 = min(num_tokens, r0 + _ROWS)
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


def quality_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sq_run=None, **kwargs):
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    run: Run = sq_run
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


AttentionInterface.register(IMPLEMENTATION, quality_attention)


def load_documents(data_dir: Path, split: str) -> list[np.ndarray]:
    import litdata

    dataset = litdata.StreamingDataset(str(data_dir / split))
    return [np.asarray(dataset[i]["tokens"], dtype=np.int64) for i in range(len(dataset))]


def pack_streams(docs: list[np.ndarray], length: int, count: int, seed: int) -> list[dict]:
    """``count`` streams of exactly ``length`` tokens from the documents in a seeded order (module docstring)."""
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
        raise SystemExit(f"only {len(streams)} streams of {length} tokens from {len(docs)} held-out documents")
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
def forward(model, stream: dict, run: Run) -> tuple[float, int]:
    hidden = model.model(input_ids=stream["input_ids"][None], position_ids=stream["position_ids"][None],
                         use_cache=False, sq_run=run).last_hidden_state
    loss_sum, count = chunked_cross_entropy_sum(hidden[0], model.lm_head.weight, stream["targets"], 1024)
    return float(loss_sum), int(count)


def summarise(variant: Variant, per_stream: list[dict], dense: list[tuple[float, int]], num_layers: int) -> dict:
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


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"Model {meta['model']}, held-out split {meta['split']} of {meta['data']}; "
             f"block {meta['block_size']}; exact recall over every row.", ""]
    for cell in results:
        lines += [f"### {cell['length']} tokens, tau {cell['tau']}: {cell['streams']} streams "
                  f"({cell['documents']} document pieces), dense loss {cell['dense_loss']:.4f}", ""]
        lines += ["| variant | settings | density | exact recall | estimated recall | estimate - exact (mean) | "
                  "max layer abs(est - exact) | layers within 0.02 | min layer recall | loss | loss vs dense "
                  "(median stream) | s/stream |", "|" + "---|" * 12]
        for r in cell["variants"]:
            lines.append(
                f"| {r['variant']} | {r['settings']} | {r['density']:.3f} | {r['exact_recall']:.3f} | "
                f"{r['estimated_recall']:.3f} | {r['estimated_recall'] - r['exact_recall']:+.3f} | "
                f"{r['max_layer_estimate_error']:.3f} | {r['layers_estimate_within_0.02']}/{len(r['layers'])} | "
                f"{r['min_layer_exact_recall']:.3f} | {r['loss']:.4f} | {100 * r['loss_gap']:+.2f}% "
                f"({100 * r['loss_gap_median_stream']:+.2f}%) | {r['seconds_per_stream']:.0f} |")
        lines.append("")
        for r in cell["variants"]:
            lines += [f"<details><summary>{r['variant']} per layer</summary>", "",
                      "| layer | density | exact recall | estimated recall | est - exact |", "|---|---|---|---|---|"]
            for i, x in enumerate(r["layers"]):
                lines.append(f"| {i} | {x['density']:.3f} | {x['exact_recall']:.3f} | {x['estimated_recall']:.3f} | "
                             f"{x['estimate_error']:+.3f} |")
            lines += ["", "</details>", ""]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="data/smollm2-135m")
    parser.add_argument("--data", default="data/smollm2-text", help="corpus built by build_splits (configs/smollm2.yaml)")
    parser.add_argument("--split", default="val")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--taus", type=float, nargs="+", default=[0.9])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--variants", nargs="+", default=["base"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="folder for results.json and results.md")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = [Variant.parse(v) for v in args.variants]
    model = ModelConfig(pretrained_path=args.model).build(IMPLEMENTATION).eval()
    num_layers = model.config.num_hidden_layers
    docs = load_documents(Path(args.data), args.split)
    meta = {"model": args.model, "data": args.data, "split": args.split, "block_size": args.block_size,
            "held_out_documents": len(docs), "command": " ".join(sys.argv)}
    results = []
    forwards = len(args.lengths) * args.streams * (1 + len(args.taus) * len(variants))
    columns = (TextColumn("{task.description:<32}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with LoggedProgress(*columns, transient=True) as bar:
        task = bar.add_task("", total=forwards)
        for length in args.lengths:
            streams = pack_streams(docs, length, args.streams, args.seed)
            bar.update(task, description=f"{length} dense")
            dense = []
            for s in streams:
                dense.append(forward(model, s, Run(s["cu_seqlens"], args.block_size, None, 1.0)))
                bar.advance(task)
            for tau in args.taus:
                cell = {"length": length, "tau": tau, "streams": len(streams),
                        "documents": sum(len(s["doc_lengths"]) for s in streams),
                        "dense_loss": sum(d[0] for d in dense) / sum(d[1] for d in dense), "variants": []}
                results.append(cell)
                for variant in variants:
                    bar.update(task, description=f"{length} tau {tau} {variant.name}")
                    per_stream = []
                    for s in streams:
                        run = Run(s["cu_seqlens"], args.block_size, variant, tau)
                        start = time.perf_counter()
                        loss_sum, tokens = forward(model, s, run)
                        per_stream.append({"loss_sum": loss_sum, "tokens": tokens, "layers": run.layers,
                                           "seconds": time.perf_counter() - start})
                        bar.advance(task)
                    summary = summarise(variant, per_stream, dense, num_layers)
                    cell["variants"].append(summary)
                    bar.console.print(
                        f"{length} tau {tau} {variant.name}: density {summary['density']:.3f} exact "
                        f"{summary['exact_recall']:.3f} est {summary['estimated_recall']:.3f} max layer err "
                        f"{summary['max_layer_estimate_error']:.3f} loss gap {100 * summary['loss_gap']:+.2f}%",
                        soft_wrap=True)
                    if args.out:
                        _write(Path(args.out), meta, results)
    print(markdown(results, meta))


def _write(out: Path, meta: dict, results: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results, meta) + "\n")


if __name__ == "__main__":
    main()
