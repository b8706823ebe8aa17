"""Does sparse fine-tuning close the gap that sparse attention costs a pretrained model?

Sparse attention costs a pretrained model some loss. Does fine-tuning *with* sparse attention win it back? From
one base model, two copies are fine-tuned on the same training documents in the same order, with the same steps
and optimiser settings: one with dense attention, one with sparse attention at a fixed budget (``--tau``). Both
are then scored like the base model on held-out streams, with the passes of ``sparsebalance_pl.selection_quality``
(sparse loss, density, exact recall over every query row, estimated recall; dense loss of the same model), and the gap
before (base model, sparse against dense) is set against the gap after (the sparse fine-tune's sparse loss
against the dense fine-tune's dense loss: the same steps spent with dense attention). The dense fine-tune's own
gap (its sparse loss against its dense loss) is what fine-tuning on this text does without sparse training.

Training is the project's own ``main.py fit`` with ``--config`` and overrides, one subprocess and output folder
per run, then ``main.py export``. What the overrides change, and why:

- documents cut at ``--length`` tokens into a training corpus of their own (``OUT/corpus-LENGTH``, built by the
  configuration's data module from the same files), micro-batches of at most ``--length`` tokens;
- ``data.batching.method=first_fit``: sparsity-aware batching plans from the run's cost model, which differs
  between dense and sparse attention, so the two runs would train on different micro-batches. The benchmark
  builds both configurations and checks that their plans for the steps run are identical;
- no dynamic sparsity tuning and no density calibration (which only serves sparsity-aware batching): the sparse
  run keeps the fixed base budget at every layer, the budget the evaluation uses;
- no validation during training, one checkpoint at the end.

Held out: the evaluation streams come from the ``val`` split of ``--eval-data``; training reads the ``train``
split of its own corpus only. Both corpora split files, not documents, into train and val
(``builder.source_file_splits``); the study reproduces both splits from their manifests, confirms each
reproduced val split by re-encoding its files (they must give exactly the split's documents), and then checks
(1) that no training file is an evaluation file, by path or by content, and (2) at token level, which
``--ngram``-token windows of each val document occur anywhere in the training split. Distinct files can still
be near-copies (a licence's next version, code generated from another file): val documents with more than
``--max-shared`` of their windows in training are dropped before the streams are packed, and the share left in
the streams is reported.

    python experiments/sparse_finetune.py --length 4096 --streams 3 --steps 8 --lr 1e-4 --warmup-steps 1 \\
        --out outputs/sparse_finetune

(the defaults: about 50 minutes on 2 shared CPU cores).

``--resume`` reuses the phases of an earlier run in ``--out`` whose settings match (a stopped run goes on).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from sparsebalance_pl.datamodules.builder import read_manifest, source_documents, source_file_splits
from sparsebalance_pl.errors import DataError
from sparsebalance_pl.model import ModelConfig
from sparsebalance_pl.selection_quality import (
    IMPLEMENTATION, SelectionVariant, dense_losses, load_documents, pack_streams, sparse_pass, summarise,
)

REPO = Path(__file__).resolve().parents[1]

BACKENDS = ("dense", "sparse")
FIT_KEYS = ("model", "config", "length", "tau", "block_size", "stride", "steps", "lr", "warmup_steps", "min_lr_ratio",
            "devices", "activation_checkpointing")
"""The arguments a fine-tune depends on (``--resume`` reuses one whose arguments match)."""
MAX_SHARED_PIECE = 0.5
"""A piece of an evaluation stream more than this share of whose windows occur in the training split is a
near-copy of training text (its whole document passed ``--max-shared``): the run stops rather than score it as
held out."""


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="data/smollm2-135m", help="base model (Hugging Face directory)")
    parser.add_argument("--config", default="configs/smollm2.yaml", help="training configuration of main.py fit")
    parser.add_argument("--eval-data", default="data/smollm2-text", help="corpus whose val split is evaluated")
    parser.add_argument("--length", type=int, default=4096, help="tokens per training micro-batch and eval stream")
    parser.add_argument("--streams", type=int, default=3, help="held-out evaluation streams")
    parser.add_argument("--tau", type=float, default=0.9, help="sparse budget in training and evaluation")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--stride", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="optimiser steps of each fine-tune")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--devices", type=int, default=1, help="CPU ranks of each fine-tune")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--ngram", type=int, default=32, help="window length of the token-level held-out check")
    parser.add_argument("--max-shared", type=float, default=0.1,
                        help="drop val documents with more than this share of their windows in the training split")
    parser.add_argument("--seed", type=int, default=0, help="seed of the evaluation streams")
    parser.add_argument("--iso-taus", type=float, nargs="*", default=[0.85, 0.88],
                        help="further taus at which the fine-tunes are scored, to compare them at the base density")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the evaluations")
    parser.add_argument("--resume", action="store_true", help="reuse finished phases of an earlier run in --out")
    parser.add_argument("--out", required=True, help="folder for the runs, results.json and table.md")
    args = parser.parse_args(argv)
    problems = [
        (args.steps < 1, f"--steps={args.steps} must be at least 1"),
        (args.lr <= 0, f"--lr={args.lr} must be positive"),
        (not 0 <= args.warmup_steps < args.steps, f"--warmup-steps={args.warmup_steps} must lie in [0, --steps)"),
        (not 0 <= args.min_lr_ratio <= 1, f"--min-lr-ratio={args.min_lr_ratio} must lie in [0, 1]"),
        (not all(0 < t <= 1 for t in [args.tau, *args.iso_taus]), "--tau and --iso-taus must lie in (0, 1]"),
        (args.length < args.block_size or args.length % args.block_size,
         f"--length={args.length} must be a positive multiple of --block-size={args.block_size}"),
        (args.streams < 1 or args.devices < 1 or args.threads < 1,
         "--streams, --devices and --threads must be at least 1"),
        (args.ngram < 2, f"--ngram={args.ngram} must be at least 2"),
        (not 0 <= args.max_shared <= 1, f"--max-shared={args.max_shared} must lie in [0, 1]"),
    ]
    for bad, message in problems:
        if bad:
            raise SystemExit(f"error: {message}")
    return args


def check_paths(args: argparse.Namespace) -> None:
    """The inputs exist, before minutes of work start."""
    for path, what in ((Path(args.model) / "config.json", "--model has no config.json"),
                       (Path(args.config), "--config does not exist"),
                       (Path(args.eval_data) / "val" / "index.json", "--eval-data has no val split")):
        if not path.is_file():
            raise SystemExit(f"error: {what} ({path})")


# ------------------------------------------------------------------------------------------- training runs
def overlay(run_dir: Path) -> dict:
    """The configuration layer of one fine-tune: its own folder, no validation, no DST or density calibration,
    a CSV log written every step (the benchmark reads it) and one checkpoint at the end."""
    return {"trainer": {
        "enable_progress_bar": False,
        "limit_val_batches": 0,
        "default_root_dir": str(run_dir),
        "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                   "init_args": {"save_dir": str(run_dir), "name": "logs", "version": 0,
                                 "flush_logs_every_n_steps": 1}},
        "callbacks": [
            {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor",
             "init_args": {"logging_interval": "step"}},
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
             "init_args": {"dirpath": str(run_dir / "checkpoints"), "save_top_k": 0, "save_last": True}},
        ],
    }}


def cli_args(args: argparse.Namespace, out: Path, backend: str) -> list[str]:
    """``main.py`` arguments of the ``backend`` fine-tune (after the subcommand): the two runs differ only in
    ``model.attention.backend`` and their output folder."""
    run_dir = out / backend
    return [
        "--config", args.config, "--config", str(run_dir / "overlay.yaml"),
        f"--trainer.max_steps={args.steps}", f"--trainer.devices={args.devices}",
        f"--model.model.pretrained_path={args.model}",
        f"--model.attention.backend={backend}", f"--model.attention.tau={args.tau}",
        f"--model.attention.block_size={args.block_size}", f"--model.attention.stride={args.stride}",
        f"--model.activation_checkpointing={str(args.activation_checkpointing).lower()}",
        f"--model.optim.lr={args.lr}", f"--model.optim.warmup_steps={args.warmup_steps}",
        f"--model.optim.min_lr_ratio={args.min_lr_ratio}",
        f"--data.corpus.data_dir={out / f'corpus-{args.length}'}", f"--data.corpus.max_doc_tokens={args.length}",
        f"--data.batching.max_tokens={args.length}", "--data.batching.method=first_fit",
        f"--data.evaluation.lengths=[{args.length}]",
    ]


def training_plan(arguments: list[str], steps: int, ranks: int):
    """(the configuration's data module, with its corpus built; its micro-batches of the first ``steps`` steps,
    per step and rank), as ``main.py fit`` parses and plans them."""
    from sparsebalance_pl.cli import main as cli_main

    cli = cli_main(arguments, run=False)
    data = cli.datamodule
    data.connect(cli.model.sparse_attention.cost_model)
    data.prepare_data()
    plan = data.train_plan(ranks, 0).plan()
    if len(plan) < steps:
        raise SystemExit(f"error: one epoch of the training corpus has {len(plan)} steps, fewer than --steps={steps}")
    return data, [step.micro_batches for step in plan[:steps]]


def run_fit(arguments: list[str], run_dir: Path, steps: int) -> None:
    """``main.py fit`` in a subprocess (log in ``run_dir/fit.log``), a progress line per finished step."""
    for stale in ("logs", "checkpoints"):  # an earlier run's log or checkpoint must not pass for this one's
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    log = run_dir / "fit.log"
    metrics = run_dir / "logs" / "version_0" / "metrics.csv"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, str(REPO / "main.py"), "fit", *arguments], stdout=sink,
                                stderr=subprocess.STDOUT)
        seen = 0
        while proc.poll() is None:
            time.sleep(10)
            for row in training_rows(metrics)[seen:]:
                seen += 1
                progress(f"  {run_dir.name} step {seen}/{steps}: loss {float(row['train/loss']):.4f}, "
                         f"{float(row['train/step_s']):.0f} s")
    if proc.returncode:
        raise SystemExit(f"error: main.py fit of {run_dir.name} failed (exit {proc.returncode}): "
                         f"{_last_line(log)}; see {log}")


def _last_line(path: Path) -> str:
    lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    return lines[-1] if lines else "no output"


def training_rows(metrics: Path) -> list[dict]:
    """The per-step training rows of a run's CSV log (none before its first step)."""
    if not metrics.is_file():
        return []
    with metrics.open() as f:
        return [row for row in csv.DictReader(f) if row.get("train/loss")]


def training_summary(run_dir: Path) -> dict:
    rows = training_rows(run_dir / "logs" / "version_0" / "metrics.csv")
    losses = [float(r["train/loss"]) for r in rows]
    return {
        "steps": len(rows),
        "train_loss": losses,
        "tokens": sum(float(r["train/tokens"]) for r in rows),
        "mean_step_s": statistics.fmean(float(r["train/step_s"]) for r in rows),
        "density": [float(r["train/density"]) for r in rows if r.get("train/density")],
    }


def export(run_dir: Path) -> Path:
    """The run's last checkpoint as a Hugging Face directory (``run_dir/hf``), through ``main.py export``."""
    hf = run_dir / "hf"
    result = subprocess.run([sys.executable, str(REPO / "main.py"), "export", "--ckpt_path",
                             str(run_dir / "checkpoints" / "last.ckpt"), "--out_dir", str(hf)],
                            capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"error: main.py export of {run_dir.name} failed: {(result.stderr or result.stdout).strip()}")
    return hf


# ---------------------------------------------------------------------------------------- held-out check
def split_files(manifest: dict) -> tuple[list[str], list[str]]:
    """(train files, val files) of a folder or installed corpus, as ``build_splits`` split them."""
    try:
        return source_file_splits(manifest)
    except DataError as err:
        raise SystemExit(f"error: {err}: the split cannot be checked by files") from None


def digest(tokens) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype=np.int64).tobytes()).hexdigest()


def confirm_val_split(corpus: Path, manifest: dict, val_files: list[str]) -> dict[str, str]:
    """Re-encoding ``val_files`` must give exactly the documents of the corpus's val split; returns the file of
    each document, by ``digest``."""
    quiet = logging.getLogger(source_documents.__module__)
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the warnings about split documents were printed when the corpus was built
    try:
        encoded = {digest(s["tokens"]): f for f in val_files for s in source_documents(f, manifest)}
    finally:
        quiet.setLevel(level)
    stored = [digest(d) for d in load_documents(corpus, "val")]
    if sorted(encoded) != sorted(stored):
        raise SystemExit(f"error: the val files reproduced from {corpus / 'manifest.json'} do not encode to its val "
                         "split (files changed since it was built?): the held-out check cannot be made")
    return encoded


def file_overlap(eval_files: list[str], train_files: list[str]) -> dict:
    """Training files that are evaluation files, by path or by content."""
    def contents(files):
        return {hashlib.sha256(Path(f).read_bytes()).hexdigest(): f for f in files}

    shared_content = contents(eval_files).keys() & contents(train_files).keys()
    return {"eval_files": len(eval_files), "train_files": len(train_files),
            "shared_paths": sorted(set(eval_files) & set(train_files)), "shared_contents": len(shared_content)}


def window_hashes(doc: np.ndarray, n: int) -> np.ndarray:
    """A 64-bit polynomial hash of every ``n``-token window of ``doc`` (none when it is shorter)."""
    doc = np.asarray(doc, dtype=np.uint64)
    count = len(doc) - n + 1
    hashes = np.zeros(max(count, 0), dtype=np.uint64)
    if count > 0:
        for j in range(n):  # wraps modulo 2**64, as a hash may
            hashes = hashes * np.uint64(1_000_003) + doc[j : j + count]
    return hashes


def training_windows(train_docs: list[np.ndarray], n: int) -> np.ndarray:
    """The sorted distinct window hashes of the training documents."""
    return np.unique(np.concatenate([window_hashes(d, n) for d in train_docs] + [np.zeros(0, np.uint64)]))


def window_share(doc: np.ndarray, train: np.ndarray, n: int) -> tuple[int, int]:
    """(windows of ``doc``, how many of them occur in ``train``, from ``training_windows``)."""
    hashes = window_hashes(doc, n)
    if not len(train) or not len(hashes):
        return len(hashes), 0
    found = train[np.minimum(np.searchsorted(train, hashes), len(train) - 1)]
    return len(hashes), int((found == hashes).sum())


def shared_windows(eval_docs: list[np.ndarray], train: np.ndarray, n: int) -> dict:
    """How many ``n``-token windows of the evaluation documents occur anywhere in the training documents."""
    counts = [window_share(doc, train, n) for doc in eval_docs]
    windows, shared = sum(c[0] for c in counts), sum(c[1] for c in counts)
    shares = [hits / count if count else 0.0 for count, hits in counts]
    return {"ngram": n, "eval_documents": len(eval_docs), "eval_windows": windows, "shared_windows": shared,
            "share": shared / windows if windows else 0.0, "max_document_share": max(shares, default=0.0),
            "documents_with_shared_windows": sum(s > 0 for s in shares)}


def stream_documents(streams: list[dict]) -> list[np.ndarray]:
    """The document pieces of packed evaluation streams."""
    return [piece for s in streams
            for piece in np.split(s["input_ids"].numpy(), s["cu_seqlens"][1:-1].tolist())]


def held_out_streams(docs: list[np.ndarray], dropped: list[dict], args: argparse.Namespace) -> list[dict]:
    """``selection_quality``'s evaluation streams, packed from the val documents the held-out check kept."""
    gone = {d["index"] for d in dropped}
    kept = [doc for i, doc in enumerate(docs) if i not in gone]
    try:
        return pack_streams(kept, args.length, args.streams, args.seed)
    except DataError as err:
        raise SystemExit(f"error: {err}") from None


def held_out_check(args: argparse.Namespace, train_corpus: Path, docs: list[np.ndarray]) -> dict:
    """The module docstring's checks on the val documents ``docs`` of ``--eval-data``: stops the run on a shared
    file; drops the documents more than ``--max-shared`` of whose windows occur in training (near-copies of
    training files, such as one licence's next version or code generated from another file), then measures the
    windows the streams packed from the rest share with training, stopping on a near-copied piece."""
    eval_corpus, n = Path(args.eval_data), args.ngram
    eval_manifest, train_manifest = read_manifest(eval_corpus), read_manifest(train_corpus)
    if eval_manifest is None or train_manifest is None:
        raise SystemExit(f"error: {eval_corpus} or {train_corpus} has no manifest.json")
    eval_val = split_files(eval_manifest)[1]
    train_files, train_val = split_files(train_manifest)
    file_of = confirm_val_split(eval_corpus, eval_manifest, eval_val)
    confirm_val_split(train_corpus, train_manifest, train_val)
    files = file_overlap(eval_val, train_files)
    files["same_file_list"] = list(eval_manifest["source"]["files"]) == list(train_manifest["source"]["files"])
    if files["shared_paths"] or files["shared_contents"]:
        raise SystemExit(f"error: training files include evaluation files: {files}")
    train = training_windows(load_documents(train_corpus, "train"), n)
    dropped = []
    for i, doc in enumerate(docs):
        count, hits = window_share(doc, train, n)
        if count and hits / count > args.max_shared:
            dropped.append({"index": i, "file": file_of[digest(doc)], "tokens": len(doc), "share": hits / count})
    tokens = shared_windows(stream_documents(held_out_streams(docs, dropped, args)), train, n)
    if tokens["max_document_share"] > MAX_SHARED_PIECE:
        raise SystemExit(f"error: an evaluation stream's document piece shares {tokens['max_document_share']:.0%} "
                         f"of its {n}-token windows with the training split: {tokens}")
    return {"files": files, "val_documents": len(docs), "dropped": dropped, "tokens": tokens}


# ------------------------------------------------------------------------------------------- evaluation
def evaluate(model_dir: str, streams: list[dict], args: argparse.Namespace, label: str, iso: bool) -> dict:
    """Dense loss of ``model_dir`` on ``streams``, and the default selection's sparse loss, density, exact and
    estimated recall at ``--tau`` (``selection_quality``'s passes), with per-stream losses; with ``iso``, the
    same sparse figures at each of ``--iso-taus`` too (``iso_density``)."""
    model = ModelConfig(pretrained_path=model_dir).build(IMPLEMENTATION).eval()
    dense = []
    for i, loss in enumerate(dense_losses(model, streams, args.block_size)):
        dense.append(loss)
        progress(f"  {label} dense stream {i + 1}/{len(streams)}")
    result = {"model": model_dir, "dense_loss": _mean_loss(dense), "dense_streams": dense,
              **_sparse_pass(model, streams, dense, args, args.tau, label)}
    result["iso"] = [_sparse_pass(model, streams, dense, args, tau, label) for tau in args.iso_taus] if iso else []
    return result


def _sparse_pass(model, streams: list[dict], dense: list, args: argparse.Namespace, tau: float, label: str) -> dict:
    variant = SelectionVariant.parse(f"base:stride={args.stride}")
    per_stream = []
    for i, stream in enumerate(sparse_pass(model, streams, variant, tau, args.block_size)):
        per_stream.append(stream)
        progress(f"  {label} sparse (tau {tau}) stream {i + 1}/{len(streams)}: {stream['seconds']:.0f} s")
    summary = summarise(variant, per_stream, dense, model.config.num_hidden_layers)
    return {"tau": tau, "sparse_loss": summary["loss"],
            "sparse_streams": [(s["loss_sum"], s["tokens"]) for s in per_stream],
            **{key: summary[key] for key in ("density", "exact_recall", "estimated_recall", "min_layer_exact_recall",
                                             "layers")}}


def iso_density(result: dict, density: float) -> float | None:
    """The sparse loss of an evaluation at ``density``, interpolated linearly between its two taus whose densities
    bracket it (None when none do): fine-tuning moves the density a tau keeps, and the base model's density is
    the fair budget to compare at."""
    points = sorted((p["density"], p["sparse_loss"]) for p in [result, *result.get("iso", [])])
    for (d0, l0), (d1, l1) in zip(points, points[1:]):
        if d0 <= density <= d1:
            return l0 if d1 == d0 else l0 + (l1 - l0) * (density - d0) / (d1 - d0)
    return None


def _mean_loss(streams: list) -> float:
    return sum(x[0] for x in streams) / sum(x[1] for x in streams)


def gap(sparse_streams: list, dense_streams: list) -> dict:
    """Relative loss gap of sparse over dense (token-weighted over the streams), and per stream."""
    return {"gap": _mean_loss(sparse_streams) / _mean_loss(dense_streams) - 1,
            "per_stream": [(s[0] / s[1]) / (d[0] / d[1]) - 1 for s, d in zip(sparse_streams, dense_streams)]}


def table_rows(base: dict, dense_ft: dict, sparse_ft: dict) -> tuple[list[dict], dict]:
    """(the table's rows, the gaps). The reference of a sparse loss is the dense loss of the model trained the
    same way with dense attention: the base model itself before fine-tuning, the dense fine-tune after. The
    dense fine-tune's own gap is what fine-tuning on this text does to the gap without sparse training."""
    before = gap(base["sparse_streams"], base["dense_streams"])
    dense_own = gap(dense_ft["sparse_streams"], dense_ft["dense_streams"])
    after = gap(sparse_ft["sparse_streams"], dense_ft["dense_streams"])
    sparse_own = gap(sparse_ft["sparse_streams"], sparse_ft["dense_streams"])
    rows = [{"model": "base", "trained_with": "-", **_row(base), "gap_vs_reference": before["gap"],
             "gap_vs_own_dense": before["gap"]},
            {"model": "dense-ft", "trained_with": "dense", **_row(dense_ft), "gap_vs_reference": dense_own["gap"],
             "gap_vs_own_dense": dense_own["gap"]},
            {"model": "sparse-ft", "trained_with": "sparse", **_row(sparse_ft), "gap_vs_reference": after["gap"],
             "gap_vs_own_dense": sparse_own["gap"]}]
    summary = {"before": before["gap"], "after": after["gap"], "dense_ft_own": dense_own["gap"],
               "sparse_ft_own": sparse_own["gap"],
               "closed_share": 1 - after["gap"] / before["gap"] if before["gap"] else None,
               "before_per_stream": before["per_stream"], "after_per_stream": after["per_stream"],
               "dense_ft_own_per_stream": dense_own["per_stream"],
               "streams_with_smaller_gap": sum(a < b for a, b in zip(after["per_stream"], before["per_stream"])),
               "base_density": base["density"]}
    reference = dense_ft["dense_loss"]
    for name, result in (("after", sparse_ft), ("dense_ft_own", dense_ft)):
        loss = iso_density(result, base["density"])
        summary[f"iso_{name}"] = None if loss is None else loss / reference - 1
    return rows, summary


def _row(result: dict) -> dict:
    return {key: result[key] for key in ("dense_loss", "sparse_loss", "density", "exact_recall", "estimated_recall")}


def _percent(value: float) -> str:
    return f"{100 * value:+.2f}%"


def markdown(rows: list[dict], summary: dict, tau: float) -> str:
    lines = [f"| model | fine-tuned with | dense loss | sparse loss (tau {tau}) | sparse vs dense reference | "
             "sparse vs own dense | density | exact recall | estimated recall |", "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['model']} | {r['trained_with']} | {r['dense_loss']:.4f} | {r['sparse_loss']:.4f} | "
                     f"{_percent(r['gap_vs_reference'])} | {_percent(r['gap_vs_own_dense'])} | {r['density']:.3f} | "
                     f"{r['exact_recall']:.3f} | {r['estimated_recall']:.3f} |")
    closed = summary["closed_share"]
    lines += ["", f"Gap before (base, sparse vs dense): {_percent(summary['before'])}; after (sparse-ft sparse vs "
                  f"dense-ft dense): {_percent(summary['after'])}"
                  + ("" if closed is None else f" ({100 * closed:.0f}% of the gap closed)")
                  + f"; smaller on {summary['streams_with_smaller_gap']} of {len(summary['before_per_stream'])} "
                  f"streams. Dense fine-tuning alone leaves the dense-ft model a gap of "
                  f"{_percent(summary['dense_ft_own'])} of its own."]
    return "\n".join(lines)


def iso_table(evaluations: dict, summary: dict) -> str:
    """Every tau each model was scored at, and the gaps interpolated at the base model's density."""
    reference = {"base": evaluations["base"]["dense_loss"], "dense-ft": evaluations["dense-ft"]["dense_loss"],
                 "sparse-ft": evaluations["dense-ft"]["dense_loss"]}
    lines = ["| model | tau | density | exact recall | sparse loss | vs dense reference |", "|---|---|---|---|---|---|"]
    for name, result in evaluations.items():
        for p in sorted([result, *result.get("iso", [])], key=lambda p: p["tau"]):
            lines.append(f"| {name} | {p['tau']} | {p['density']:.3f} | {p['exact_recall']:.3f} | "
                         f"{p['sparse_loss']:.4f} | {_percent(p['sparse_loss'] / reference[name] - 1)} |")

    def interpolated(value):
        return "not bracketed by the taus scored" if value is None else _percent(value)

    lines += ["", f"At the base model's density {summary['base_density']:.3f} (interpolated between taus): "
                  f"sparse-ft vs dense-ft dense {interpolated(summary['iso_after'])}, dense-ft's own gap "
                  f"{interpolated(summary['iso_dense_ft_own'])}; before {_percent(summary['before'])}."]
    return "\n".join(lines)


def training_table(runs: dict) -> str:
    """Each step's training loss of both fine-tunes: the same micro-batches, so the difference is attention's."""
    dense, sparse = runs["dense"], runs["sparse"]
    lines = ["| step | dense-ft train loss | sparse-ft train loss | sparse over dense | sparse training density |",
             "|---|---|---|---|---|"]
    for i, (d, s) in enumerate(zip(dense["train_loss"], sparse["train_loss"])):
        density = f"{sparse['density'][i]:.3f}" if i < len(sparse["density"]) else "-"
        lines.append(f"| {i + 1} | {d:.4f} | {s:.4f} | {_percent(s / d - 1)} | {density} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- main
class Phases:
    """Results of finished phases in ``results.json``, each under the settings it ran with; with ``resume`` a
    phase whose settings match is not run again."""

    def __init__(self, path: Path, resume: bool) -> None:
        self.path = path
        previous = json.loads(path.read_text()) if resume and path.is_file() else {}
        self.done = previous.get("phases", {})
        self.data: dict = {"phases": {}}

    def run(self, name: str, settings: dict, fn):
        stored = self.done.get(name)
        if stored is not None and stored["settings"] == settings:
            progress(f"{name}: reused from {self.path}")
            result, seconds = stored["result"], stored["seconds"]
        else:
            progress(f"{name}: start")
            start = time.time()
            result = fn()
            seconds = time.time() - start
            progress(f"{name}: done in {seconds:.0f} s")
        self.data["phases"][name] = {"settings": settings, "result": result, "seconds": seconds}
        self.save()
        return result

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    check_paths(args)
    torch.set_num_threads(args.threads)
    started = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    phases = Phases(out / "results.json", args.resume)
    phases.data["meta"] = {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "args": vars(args),
                           "commit": _commit()}
    arguments = {}
    for backend in BACKENDS:
        run_dir = out / backend
        run_dir.mkdir(exist_ok=True)
        (run_dir / "overlay.yaml").write_text(yaml.safe_dump(overlay(run_dir), sort_keys=False))
        arguments[backend] = cli_args(args, out, backend)

    progress("plan: building both configurations and the training corpus")
    plans = {backend: training_plan(arguments[backend], args.steps, args.devices) for backend in BACKENDS}
    if plans["dense"][1] != plans["sparse"][1]:
        raise SystemExit("error: the dense and sparse runs would train on different micro-batches")
    data, plan = plans["dense"]
    trained = sorted({int(i) for step in plan for rank in step for mb in rank for i in mb})
    lengths = data.lengths("train")
    phases.data["plan"] = {"steps": args.steps, "ranks": len(plan[0]), "micro_batches_per_rank": len(plan[0][0]),
                           "documents": len(trained), "tokens": int(lengths[trained].sum()),
                           "training_corpus_documents": len(lengths), "identical_for_both_runs": True}
    progress(f"plan: {len(trained)} training documents, {int(lengths[trained].sum())} tokens in {args.steps} steps; "
             "the same micro-batches for both runs")

    docs = load_documents(Path(args.eval_data), "val")
    eval_settings = {k: getattr(args, k) for k in ("eval_data", "length", "streams", "seed", "tau", "block_size",
                                                   "stride", "ngram", "max_shared")}
    check = phases.run("held-out check", {**eval_settings, "corpus": str(data.data_dir)},
                       lambda: held_out_check(args, data.data_dir, docs))
    streams = held_out_streams(docs, check["dropped"], args)
    progress(f"held-out check: no shared file; {len(check['dropped'])} of {len(docs)} val documents dropped as "
             f"near-copies of training text; {check['tokens']['share']:.2%} of the streams' {args.ngram}-token "
             "windows occur in training")

    base = phases.run("evaluate base", {**eval_settings, "model": args.model},
                      lambda: evaluate(args.model, streams, args, "base", iso=False))
    fit_settings = {k: getattr(args, k) for k in FIT_KEYS}
    models, runs = {}, {}
    for backend in BACKENDS:
        run_dir = out / backend

        def fine_tune(run_dir=run_dir, backend=backend) -> dict:
            start = time.time()
            run_fit(arguments[backend], run_dir, args.steps)
            return {**training_summary(run_dir), "hf": str(export(run_dir)), "wall_s": time.time() - start,
                    "command": "python main.py fit " + " ".join(arguments[backend])}

        runs[backend] = phases.run(f"fine-tune {backend}", fit_settings, fine_tune)
        models[backend] = runs[backend]["hf"]
    iso_settings = {**eval_settings, "iso_taus": args.iso_taus}
    dense_ft = phases.run("evaluate dense-ft", {**iso_settings, "model": models["dense"]},
                          lambda: evaluate(models["dense"], streams, args, "dense-ft", iso=True))
    sparse_ft = phases.run("evaluate sparse-ft", {**iso_settings, "model": models["sparse"]},
                           lambda: evaluate(models["sparse"], streams, args, "sparse-ft", iso=True))

    rows, summary = table_rows(base, dense_ft, sparse_ft)
    phases.data.update(rows=rows, gap=summary, runs=runs, wall_s=time.time() - started)
    phases.save()
    text = markdown(rows, summary, args.tau)
    evaluations = {"base": base, "dense-ft": dense_ft, "sparse-ft": sparse_ft}
    parts = [describe(phases.data, check), text, iso_table(evaluations, summary), training_table(runs)]
    (out / "table.md").write_text("\n\n".join(parts) + "\n")
    print(text)
    progress(f"done in {time.time() - started:.0f} s; wrote {out / 'results.json'} and {out / 'table.md'}")


def describe(data: dict, check: dict) -> str:
    """What the table measured: the command, the fine-tunes and the held-out streams."""
    args, plan, runs = data["meta"]["args"], data["plan"], data["runs"]
    fits = "; ".join(f"{name}: {r['mean_step_s']:.0f} s a step, {r['wall_s'] / 60:.1f} min with start-up and export"
                     for name, r in runs.items())
    tokens = check["tokens"]
    return "\n".join([
        f"`python {data['meta']['command']}` (commit {data['meta']['commit'][:10]}): {data['wall_s'] / 60:.1f} min; "
        f"its phases took {sum(p['seconds'] for p in data['phases'].values()) / 60:.1f} min in all, reused ones "
        "included.",
        "",
        f"Fine-tunes: {plan['steps']} steps on {plan['ranks']} CPU rank(s), {plan['micro_batches_per_rank']} "
        f"micro-batch of at most {args['length']} tokens per rank and step ({plan['documents']} documents, "
        f"{plan['tokens']} tokens, the same for both), AdamW lr {args['lr']} (warm-up {args['warmup_steps']}, cosine "
        f"to {args['min_lr_ratio']} x); sparse at tau {args['tau']} (block {args['block_size']}, stride "
        f"{args['stride']}) with no DST. {fits}.",
        "",
        f"Held out: {args['streams']} streams of {args['length']} tokens from the val split of {args['eval_data']} "
        f"({tokens['eval_documents']} document pieces); no training file shared by path or content; "
        f"{len(check['dropped'])} of {check['val_documents']} val documents dropped (more than {args['max_shared']} "
        f"of their {args['ngram']}-token windows in training); {100 * tokens['share']:.2f}% of the streams' windows "
        f"occur in training (largest share of a piece {100 * tokens['max_document_share']:.1f}%).",
    ])


def _commit() -> str:
    result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return result.stdout.strip()


if __name__ == "__main__":
    main()
