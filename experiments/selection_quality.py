"""Selection quality on a real pretrained model and held-out real text.

For each selection variant and each (length, tau), runs the model zero-shot over several packed streams of
held-out real documents with sparse attention chosen by that variant (``sparsebalance_pl.selection_quality``),
and reports per layer and on average:

- density: kept tiles over candidate tiles (causal tiles within documents), as ``SelectionStats.mean_density``;
- exact recall: the exact share of each query's softmax mass (causal, within its document) that falls on the
  kept tiles, over **every** query token and head of the stream (no sampling), on the activations the sparse
  model itself produces;
- estimated recall: what the selection believes it kept (``SelectionStats.mean_kept_mass``);
- loss: the mean next-token loss of the stream with that variant against the same streams with dense attention.

Figures are means over streams (per-layer values are means over streams; the "mean" row is the mean over
layers); the loss gap is the relative difference of the token-weighted loss over all streams, with its median
over streams beside it.

    python experiments/selection_quality.py --lengths 4096 --taus 0.9 --streams 4 \\
        --variants base "s8:stride=8" --out outputs/selection_quality

A variant is ``name`` or ``name:key=value,key=value`` with keys passed to ``rank_blocks`` (``stride``,
``estimate``, ``sink_blocks``, ``local_blocks``, ``recall_probes``, ``per_head_tau``: ``SELECTION_OPTIONS``) or
``max_density``/``tau`` (``tau`` replaces the --taus value), or ``late_from``/``late_tau``: layers from
``late_from`` on use ``late_tau`` instead (``SelectionVariant``). ``base`` is the default selection.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

from sparsebalance_pl.errors import ConfigError, DataError
from sparsebalance_pl.model import ModelConfig
from sparsebalance_pl.progress import LoggedProgress
from sparsebalance_pl.selection_quality import (
    IMPLEMENTATION, SelectionVariant, dense_losses, load_documents, pack_streams, sparse_pass, summarise,
)


def markdown(results: list[dict], meta: dict) -> str:
    """Per (length, tau) a table of the variants, and each variant's layers."""
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
    parser.add_argument("--data", default="data/smollm2-text",
                        help="corpus built by build_splits (configs/smollm2.yaml)")
    parser.add_argument("--split", default="val")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--taus", type=float, nargs="+", default=[0.9])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--variants", nargs="+", default=["base"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="folder for results.json and table.md")
    args = parser.parse_args(argv)
    try:  # every variant checked before the model is loaded
        args.variants = [SelectionVariant.parse(v) for v in args.variants]
    except ConfigError as err:
        parser.error(str(err))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = args.variants
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
            try:
                streams = pack_streams(docs, length, args.streams, args.seed)
            except DataError as err:
                raise SystemExit(f"error: {err}") from None
            bar.update(task, description=f"{length} dense")
            dense = []
            for loss in dense_losses(model, streams, args.block_size):
                dense.append(loss)
                bar.advance(task)
            for tau in args.taus:
                cell = {"length": length, "tau": tau, "streams": len(streams),
                        "documents": sum(len(s["doc_lengths"]) for s in streams),
                        "dense_loss": sum(d[0] for d in dense) / sum(d[1] for d in dense), "variants": []}
                results.append(cell)
                for variant in variants:
                    bar.update(task, description=f"{length} tau {tau} {variant.name}")
                    per_stream = []
                    for stream in sparse_pass(model, streams, variant, tau, args.block_size):
                        per_stream.append(stream)
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
    (out / "table.md").write_text(markdown(results, meta) + "\n")


if __name__ == "__main__":
    main()
