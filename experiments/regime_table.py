"""Regime table of sparse attention on the real model: selection quality and retrieval by length and kind of text.

For each context length, each kind of text (prose, code) and each tau, the zero-shot selection quality of the
default selection (``sparsebalance_pl.selection_quality``, as ``experiments/selection_quality.py`` measures it:
density, exact recall over every query row, estimated recall, next-token loss against dense attention), and
per length the synthetic retrieval accuracy (pass key, multi-key needle: ``datamodules/eval_tasks.py``, scored
by teacher-forced exact match as ``main.py test`` scores them) with dense attention and with the project's sparse
attention (``sparsebalance_pl.attention``, the selection and block-sparse kernel training uses) at each tau.

Kind of a document: the corpus's samples record only tokens, so each document's source file is recovered from
the corpus's ``manifest.json`` (its file list, split as ``build_splits`` splits it) by re-encoding the split's
files exactly as the builder did and matching the token arrays; the kind is then the file's suffix: ``.py`` is
code, ``.md``, ``.rst``, ``.txt``, ``.jsonl`` and names without a letter suffix (licences such as ``GPL-3``) are
prose (``classify_path``). Documents whose file changed or vanished since the build match nothing and are left
out (counted in the results). A kind whose documents in ``--split`` are too few for the requested streams is
taken from ``--fallback-split`` (the pretrained model never saw either split of this corpus), said per cell.

    python experiments/regime_table.py --lengths 1024 2048 4096 --taus 0.8 0.9 0.95 --streams 1 --samples 2 \\
        --out outputs/regime_table

Lengths run smallest first; results.json and table.md are rewritten after every tau and every attention, so
an interrupted run keeps what it measured. Runs split by part, length or kind (``--parts``, ``--lengths``,
``--kinds``) are put in one table with ``--merge DIR [DIR ...] --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from sparsebalance_pl.datamodules.builder import source_documents, source_file_splits
from sparsebalance_pl.errors import DataError
from sparsebalance_pl.selection_quality import (
    IMPLEMENTATION, SelectionVariant, dense_losses, load_documents, pack_streams, sparse_pass, summarise,
)

KINDS = ("prose", "code")
CODE_SUFFIXES = (".py",)
PROSE_SUFFIXES = (".md", ".rst", ".txt", ".jsonl")
RETRIEVAL_TASKS = ("passkey", "multikey_niah")
PARTS = ("quality", "retrieval")
TASK_LABELS = {"passkey": "pass key", "multikey_niah": "needle (multi-key)", "kv_retrieval": "key-value"}


class UsageError(SystemExit):
    """A one-line error about the command's arguments."""

    def __init__(self, message: str) -> None:
        super().__init__(f"regime_table: error: {message}")


def classify_path(path: str) -> str:
    """``code`` or ``prose`` from a source file's name (a ``.jsonl`` document is named ``file.jsonl:line``)."""
    name = Path(str(path).rsplit(":", 1)[0] if ".jsonl:" in str(path) else str(path)).name
    suffix = Path(name).suffix
    if suffix in CODE_SUFFIXES:
        return "code"
    if suffix in PROSE_SUFFIXES or not suffix[1:2].isalpha():
        return "prose"
    raise ValueError(f"{path}: no kind for the suffix {suffix!r}")


def log(message: str) -> None:
    print(f"[{datetime.now(timezone.utc):%H:%M:%S}] {message}", flush=True)


# ---------------------------------------------------------------------------------------------------- arguments
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="data/smollm2-135m")
    parser.add_argument("--data", default="data/smollm2-text",
                        help="corpus built by build_splits (configs/smollm2.yaml)")
    parser.add_argument("--split", default="val", help="where each kind's documents come from")
    parser.add_argument("--fallback-split", default="train",
                        help="where a kind comes from when --split holds too few of its tokens ('none': fail)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS))
    parser.add_argument("--taus", type=float, nargs="+", default=[0.8, 0.9, 0.95])
    parser.add_argument("--streams", type=int, default=1, help="streams per (length, kind) cell")
    parser.add_argument("--samples", type=int, default=2,
                        help="retrieval samples per (task, length) for each attention (0: no retrieval)")
    parser.add_argument("--tasks", nargs="+", default=list(RETRIEVAL_TASKS))
    parser.add_argument("--parts", nargs="+", default=list(PARTS),
                        help="what to measure: quality (density, recall, loss), retrieval, or both")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="folder for results.json and table.md")
    parser.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                        help="measure nothing: merge the results.json of these runs' folders into --out")
    args = parser.parse_args(argv)
    if args.merge is not None:
        if args.out is None:
            raise UsageError("--merge needs --out")
        return args
    check_args(args)
    args.lengths = sorted(set(args.lengths))
    return args


def check_args(args: argparse.Namespace) -> None:
    from sparsebalance_pl.datamodules.eval_tasks import TASKS

    unknown = [k for k in args.kinds if k not in KINDS]
    if unknown:
        raise UsageError(f"--kinds {' '.join(unknown)}: unknown kind; allowed: {', '.join(KINDS)}")
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        raise UsageError(f"--parts {' '.join(unknown)}: unknown part; allowed: {', '.join(PARTS)}")
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        raise UsageError(f"--tasks {' '.join(unknown)}: unknown task; allowed: {', '.join(TASKS)}")
    if args.block_size < 16 or args.block_size & (args.block_size - 1):
        raise UsageError(f"--block-size {args.block_size}: must be a power of two of at least 16")
    for length in args.lengths:
        if length <= 0 or length % args.block_size:
            raise UsageError(f"--lengths {length}: must be a positive multiple of --block-size {args.block_size}")
    for tau in args.taus:
        if not 0.0 < tau <= 1.0:
            raise UsageError(f"--taus {tau}: must lie in (0, 1]")
    if args.streams < 1:
        raise UsageError(f"--streams {args.streams}: must be at least 1")
    if args.samples < 0:
        raise UsageError(f"--samples {args.samples}: must be at least 0")
    if args.threads < 1:
        raise UsageError(f"--threads {args.threads}: must be at least 1")


# ---------------------------------------------------------------------------------------------------- documents
def split_files(manifest: dict, split: str) -> list[str]:
    """The source files of ``split`` as ``build_splits`` divided the manifest's files."""
    if split not in ("train", "val"):
        raise UsageError(f"--split {split}: must be train or val")
    try:
        train, val = source_file_splits(manifest)
    except DataError as err:
        raise UsageError(f"{err} (a synthetic corpus has no kinds)") from None
    return train if split == "train" else val


def match_kinds(docs: list[np.ndarray], pieces: dict[bytes, str]) -> list[str | None]:
    """Each document's kind from ``pieces`` (token bytes as int64 -> kind); None where none matches."""
    return [pieces.get(np.asarray(d, dtype=np.int64).tobytes()) for d in docs]


def encoded_pieces(files: list[str], manifest: dict, kinds: set[str]) -> dict[bytes, str]:
    """token bytes -> kind of every piece the builder made of ``files`` of the wanted ``kinds``."""
    pieces = {}
    for path in files:
        try:
            kind = classify_path(path)
        except ValueError:
            continue
        if kind not in kinds or not Path(path).is_file():
            continue
        for sample in source_documents(path, manifest):
            pieces[np.asarray(sample["tokens"], dtype=np.int64).tobytes()] = kind
    return pieces


class KindDocuments:
    """The documents of each (split, kind), found on first use (``split_files``, ``encoded_pieces``); ``counts``
    says per split how many documents there were and how many of each kind matched."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.manifest = json.loads((data_dir / "manifest.json").read_text())
        self.found: dict[tuple[str, str], list[np.ndarray]] = {}
        self.counts: dict[str, dict] = {}

    def get(self, split: str, kind: str) -> list[np.ndarray]:
        if (split, kind) not in self.found:
            docs = load_documents(self.data_dir, split)
            kinds = match_kinds(docs, encoded_pieces(split_files(self.manifest, split), self.manifest, {kind}))
            self.found[split, kind] = [d for d, k in zip(docs, kinds) if k == kind]
            self.counts.setdefault(split, {"documents": len(docs)})[kind] = {
                "documents": len(self.found[split, kind]),
                "tokens": int(sum(len(d) for d in self.found[split, kind]))}
            log(f"{split}: {self.counts[split][kind]['documents']} of {len(docs)} documents are {kind} "
                f"({self.counts[split][kind]['tokens']} tokens)")
        return self.found[split, kind]


def kind_streams(documents: KindDocuments, splits: list[str], kind: str, length: int, count: int,
                 seed: int) -> tuple[list[dict], str]:
    """``count`` streams of ``kind`` from the first of ``splits`` that has enough of its tokens."""
    for split in splits:
        try:
            return pack_streams(documents.get(split, kind), length, count, seed), split
        except DataError:
            continue
    raise UsageError(f"too few {kind} tokens in {' or '.join(splits)} for {count} streams of {length} tokens")


# ---------------------------------------------------------------------------------------------------- measuring
def quality_cells(model, streams: list[dict], taus: list[float], block_size: int, num_layers: int) -> Iterator[dict]:
    """The ``base`` selection at each tau on ``streams``, summed up as ``selection_quality.summarise`` does, one
    tau at a time."""
    variant = SelectionVariant.parse("base")
    dense = list(dense_losses(model, streams, block_size))
    for tau in taus:
        per_stream = list(sparse_pass(model, streams, variant, tau, block_size))
        yield {"tau": tau, **summarise(variant, per_stream, dense, num_layers)}


@torch.no_grad()
def retrieval_correct(net, samples: list[dict], tau: float | None, block_size: int) -> tuple[list[bool], float | None]:
    """Whether each sample's answer is predicted with dense (``tau`` None) or sparse attention at ``tau``, all
    samples packed in one stream; and the mean density of the sparse selection there."""
    from sparsebalance_pl.attention import AttentionConfig, SparseAttention
    from sparsebalance_pl.datamodules.packing import collate_answers
    from sparsebalance_pl.model import ModelDims

    batch = collate_answers(samples)
    config = AttentionConfig(backend="dense" if tau is None else "sparse", block_size=block_size,
                             tau=1.0 if tau is None else tau, kernel_backend="torch")
    sparse = SparseAttention(ModelDims.from_hf_config(net.hf.config), config)
    micro_batch = sparse.begin(batch["cu_seqlens"], training=False)
    right = net(batch["input_ids"], batch["position_ids"], batch["targets"], sparse, batch["answer_spans"])
    return right.tolist(), micro_batch.mean_density()


def retrieval_cells(net, samples: list[dict], length: int, taus: list[float], block_size: int) -> Iterator[dict]:
    """Accuracy per task at ``length`` for dense attention and each tau, one attention at a time."""
    mine = [s for s in samples if s["length"] == length]
    for tau in [None, *taus]:
        start = time.perf_counter()
        right, density = retrieval_correct(net, mine, tau, block_size)
        row = {"attention": "dense" if tau is None else f"sparse tau {tau}", "tau": tau, "density": density,
               "seconds": time.perf_counter() - start, "tasks": {}}
        for sample, ok in zip(mine, right):
            cell = row["tasks"].setdefault(sample["task"], {"correct": 0, "samples": 0})
            cell["correct"] += int(ok)
            cell["samples"] += 1
        yield row


# ---------------------------------------------------------------------------------------------------- the table
def _acc(cell: dict | None) -> str:
    if not cell:
        return "-"
    return f"{cell['correct']}/{cell['samples']}"


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [f"Model {meta['model']}, corpus {meta['data']} (documents of split {meta['split']}, fallback "
             f"{meta['fallback_split']}); block {meta['block_size']}; default selection (`base`); exact recall "
             f"over every query row; {meta['streams']} stream(s) per (length, kind)."]
    if results["quality"]:
        lines += ["", "| length | kind | tau | streams (split, pieces) | density | exact recall | estimated recall | "
                  "est - exact | min layer recall | dense loss | sparse loss | loss vs dense | s/stream |",
                  "|" + "---|" * 13]
    for q in results["quality"]:
        for c in q["taus"]:
            lines.append(
                f"| {q['length']} | {q['kind']} | {c['tau']} | {q['streams']} ({q['split']}, {q['documents']}) | "
                f"{c['density']:.3f} | {c['exact_recall']:.3f} | {c['estimated_recall']:.3f} | "
                f"{c['estimated_recall'] - c['exact_recall']:+.3f} | {c['min_layer_exact_recall']:.3f} | "
                f"{c['dense_loss']:.4f} | {c['loss']:.4f} | {100 * c['loss_gap']:+.2f}% | "
                f"{c['seconds_per_stream']:.0f} |")
    if results["retrieval"]:
        tasks = meta["tasks"]
        lines += ["", "Retrieval (synthetic, scored with the model's tokenizer; correct/samples; the same samples "
                  "for every attention at a length; density: mean kept share of causal tiles on those samples):",
                  "", "| length | attention | " + " | ".join(TASK_LABELS.get(t, t) for t in tasks)
                  + " | density | s |", "|" + "---|" * (len(tasks) + 4)]
        for r in results["retrieval"]:
            for row in r["rows"]:
                density = "1.000" if row["tau"] is None else (
                    f"{row['density']:.3f}" if row["density"] is not None else "-")
                lines.append(f"| {r['length']} | {row['attention']} | "
                             + " | ".join(_acc(row["tasks"].get(t)) for t in tasks)
                             + f" | {density} | {row['seconds']:.0f} |")
    return "\n".join(lines)


def write(out: Path | None, results: dict) -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "table.md").write_text(markdown(results) + "\n")


def merge(folders: list[Path]) -> dict:
    """One result of several runs' (e.g. one length or kind each): their cells sorted by length, kind and tau
    (dense first), the first run's settings, and every run's command in ``meta["runs"]``."""
    merged = None
    for folder in folders:
        path = folder / "results.json"
        if not path.is_file():
            raise UsageError(f"--merge {folder}: no results.json there")
        run = json.loads(path.read_text())
        if merged is None:
            merged = {"meta": {**run["meta"], "runs": []}, "quality": [], "retrieval": []}
        merged["meta"]["runs"].append({"out": str(folder), **{k: run["meta"].get(k) for k in
                                                              ("command", "started", "finished")}})
        merged["quality"] += [q for q in run["quality"] if q["taus"]]
        merged["retrieval"] += [r for r in run["retrieval"] if r["rows"]]
        if run["retrieval"]:
            merged["meta"]["tasks"] = run["meta"]["tasks"]
    merged["quality"].sort(key=lambda q: (q["length"], KINDS.index(q["kind"])))
    merged["retrieval"].sort(key=lambda r: r["length"])
    for q in merged["quality"]:
        q["taus"].sort(key=lambda c: c["tau"])
    for r in merged["retrieval"]:
        r["rows"].sort(key=lambda row: -1.0 if row["tau"] is None else row["tau"])
    return merged


# ---------------------------------------------------------------------------------------------------- main
def main(argv=None) -> None:
    args = parse_args(argv)
    if args.merge is not None:
        merged = merge([Path(f) for f in args.merge])
        write(Path(args.out), merged)
        print(markdown(merged))
        return
    from sparsebalance_pl.attention import ATTN_IMPLEMENTATION
    from sparsebalance_pl.datamodules.eval_tasks import EvalConfig, make_eval_samples
    from sparsebalance_pl.datamodules.tokenizer import load_tokenizer
    from sparsebalance_pl.model import ModelConfig, PackedCausalLM

    torch.set_num_threads(args.threads)
    data, out = Path(args.data), Path(args.out) if args.out else None
    for path, what in ((Path(args.model) / "config.json", "--model"), (data / "manifest.json", "--data")):
        if not path.is_file():
            raise UsageError(f"{what}: {path} does not exist")
    documents = KindDocuments(data)
    splits = list(dict.fromkeys([args.split] + ([] if args.fallback_split == "none" else [args.fallback_split])))
    quality_model = None
    if "quality" in args.parts:
        quality_model = ModelConfig(pretrained_path=args.model).build(IMPLEMENTATION).eval()
    num_layers = ModelConfig(pretrained_path=args.model).dims().num_layers
    meta = {"model": args.model, "data": args.data, "split": args.split, "fallback_split": args.fallback_split,
            "block_size": args.block_size, "streams": args.streams, "samples": args.samples, "tasks": args.tasks,
            "taus": args.taus, "lengths": args.lengths, "threads": args.threads, "seed": args.seed,
            "eval_seed": args.eval_seed, "parts": args.parts, "command": " ".join(sys.argv),
            "documents": documents.counts, "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    results = {"meta": meta, "quality": [], "retrieval": []}
    net, samples = None, []
    if args.samples and "retrieval" in args.parts:
        tokenizer = load_tokenizer(args.model)
        samples = make_eval_samples(EvalConfig(tasks=tuple(args.tasks), lengths=tuple(args.lengths),
                                               samples_per_cell=args.samples, seed=args.eval_seed), tokenizer)
        hf = ModelConfig(pretrained_path=args.model).build(ATTN_IMPLEMENTATION).eval()
        net = PackedCausalLM(hf, loss_chunk_tokens=1024).eval()
    for length in args.lengths:
        for kind in args.kinds if quality_model is not None else []:
            streams, split = kind_streams(documents, splits, kind, length, args.streams, args.seed)
            log(f"{length} {kind}: {len(streams)} stream(s) from {split} "
                f"({sum(len(s['doc_lengths']) for s in streams)} document pieces); dense + taus {args.taus}")
            cells = []
            results["quality"].append({"length": length, "kind": kind, "split": split, "streams": len(streams),
                                       "documents": sum(len(s["doc_lengths"]) for s in streams), "taus": cells})
            for c in quality_cells(quality_model, streams, args.taus, args.block_size, num_layers):
                cells.append(c)
                log(f"{length} {kind} tau {c['tau']}: density {c['density']:.3f} exact {c['exact_recall']:.3f} "
                    f"est {c['estimated_recall']:.3f} loss gap {100 * c['loss_gap']:+.2f}% "
                    f"({c['seconds_per_stream']:.0f} s/stream)")
                write(out, results)
        if net is not None:
            log(f"{length} retrieval: {args.samples} sample(s) per task of {', '.join(args.tasks)}; dense + taus")
            rows = []
            results["retrieval"].append({"length": length, "rows": rows})
            for row in retrieval_cells(net, samples, length, args.taus, args.block_size):
                rows.append(row)
                log(f"{length} retrieval {row['attention']}: "
                    + ", ".join(f"{t} {_acc(row['tasks'].get(t))}" for t in args.tasks) + f" ({row['seconds']:.0f} s)")
                write(out, results)
    meta["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    write(out, results)
    print(markdown(results))


if __name__ == "__main__":
    main()
