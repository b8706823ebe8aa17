"""Turning documents into a litdata dataset of token arrays, with a length index beside it.

Each sample is ``{"tokens": int32 array, "length": int}``. After ``litdata.optimize`` the lengths are read back
in the dataset's own global order into ``lengths.npy``: planners need every document's length on every rank
without touching the token data. A ``manifest.json`` records what the dataset was built from, so a data
module can tell whether an existing folder still matches its configuration.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from sparsebalance_pl.datamodules.synthetic import LengthPrior, synthetic_document
from sparsebalance_pl.datamodules.tokenizer import Tokenizer, load_tokenizer
from sparsebalance_pl.errors import DataError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LENGTHS = "lengths.npy"
TEXT_SUFFIXES = (".txt", ".jsonl")


@dataclass(frozen=True)
class SyntheticSource:
    """``num_documents`` haystack documents with lengths from ``length_distribution``."""

    num_documents: int
    length_distribution: str = "wlbllm"
    seed: int = 0

    def describe(self) -> dict:
        return {"kind": "synthetic", **self.__dict__}


@dataclass(frozen=True)
class FolderSource:
    """Every ``.txt`` file (one document) and ``.jsonl`` file (one document per line, field ``text``)."""

    files: tuple[str, ...]

    @classmethod
    def scan(cls, folder: str) -> "FolderSource":
        root = Path(folder)
        if not root.is_dir():
            raise DataError(f"data.text_dir={folder!r} does not exist or is not a folder")
        files = tuple(sorted(str(p) for p in root.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()))
        if not files:
            raise DataError(f"data.text_dir={folder!r} holds no {' or '.join(TEXT_SUFFIXES)} files")
        return cls(files)

    def describe(self) -> dict:
        digest = hashlib.sha256()
        for name in self.files:
            stat = Path(name).stat()
            digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        return {"kind": "folder", "files": len(self.files), "fingerprint": digest.hexdigest()}


def read_documents(path: str) -> Iterator[str]:
    """The documents of one text file, naming the file and line of anything unreadable."""
    file = Path(path)
    try:
        raw = file.read_bytes()
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        log.warning("%s: not valid UTF-8 at byte %d; undecodable bytes replaced", path, err.start)
        text = raw.decode("utf-8", errors="replace")
    if file.suffix == ".txt":
        yield text
        return
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            yield record["text"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            log.warning("%s:%d: skipped, not a JSON object with a 'text' field (%s)", path, line_no, err)


def _encode_chunks(text: str, tokenizer: Tokenizer, max_doc_tokens: int) -> Iterator[dict]:
    """A document as samples of at most ``max_doc_tokens`` tokens (end-of-document token included)."""
    ids = tokenizer.encode(text) + [tokenizer.eos_id]
    if len(ids) < 2:
        return
    for start in range(0, len(ids), max_doc_tokens):
        piece = np.asarray(ids[start : start + max_doc_tokens], dtype=np.int32)
        if piece.size >= 2:
            yield {"tokens": piece, "length": int(piece.size)}


def _synthetic_sample(item: tuple[int, int, int], tokenizer_spec: str, max_doc_tokens: int) -> Iterator[dict]:
    seed, index, num_tokens = item
    rng = np.random.default_rng([seed, index])
    tokenizer = load_tokenizer(tokenizer_spec)
    # The byte tokenizer makes one token per character; other tokenizers are cut to length after encoding.
    yield from _encode_chunks(synthetic_document(rng, num_tokens - 1), tokenizer, max_doc_tokens)


def _folder_samples(path: str, tokenizer_spec: str, max_doc_tokens: int) -> Iterator[dict]:
    tokenizer = load_tokenizer(tokenizer_spec)
    for text in read_documents(path):
        yield from _encode_chunks(text, tokenizer, max_doc_tokens)


def _split(items: list, val_fraction: float, seed: int) -> tuple[list, list]:
    rng = np.random.default_rng([seed, 7919])
    is_val = rng.random(len(items)) < val_fraction
    if len(items) > 1 and val_fraction > 0 and not is_val.any():
        is_val[-1] = True
    return [x for x, v in zip(items, is_val) if not v], [x for x, v in zip(items, is_val) if v]


def build_splits(
    out_dir: str,
    source: SyntheticSource | FolderSource,
    *,
    tokenizer_spec: str,
    max_doc_tokens: int,
    val_fraction: float,
    num_workers: int = 1,
) -> None:
    """Build ``out_dir/train`` and ``out_dir/val`` (none when ``val_fraction`` is 0) unless they exist and
    match this configuration."""
    manifest = {
        "source": source.describe(),
        "tokenizer": tokenizer_spec,
        "max_doc_tokens": max_doc_tokens,
        "val_fraction": val_fraction,
    }
    root = Path(out_dir)
    if read_manifest(root) == manifest:
        return
    if root.exists():
        log.warning("rebuilding %s: it was built from another configuration", root)
        shutil.rmtree(root)
    if isinstance(source, SyntheticSource):
        rng = np.random.default_rng(source.seed)
        lengths = LengthPrior.load(source.length_distribution).sample(source.num_documents, rng, max_doc_tokens)
        items = [(source.seed, i, int(n)) for i, n in enumerate(lengths)]
        fn: Callable = partial(_synthetic_sample, tokenizer_spec=tokenizer_spec, max_doc_tokens=max_doc_tokens)
    else:
        items = list(source.files)
        fn = partial(_folder_samples, tokenizer_spec=tokenizer_spec, max_doc_tokens=max_doc_tokens)
    train_items, val_items = _split(items, val_fraction, getattr(source, "seed", 0))
    _optimize(fn, train_items, root / "train", num_workers)
    if val_fraction > 0:
        _optimize(fn, val_items, root / "val", num_workers)
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _optimize(fn: Callable, items: list, out: Path, num_workers: int) -> None:
    import litdata

    if not items:
        raise DataError(f"no documents for {out}: the source is too small for a train and a validation split")
    litdata.optimize(
        fn=fn,
        inputs=items,
        output_dir=str(out),
        chunk_bytes="32MB",
        num_workers=max(1, min(num_workers, len(items))),
        verbose=False,
    )
    lengths = read_lengths_from_dataset(out)
    if lengths.size == 0:
        raise DataError(f"{out}: every document was empty; nothing to train on")
    np.save(out / LENGTHS, lengths)


def read_lengths_from_dataset(path: Path) -> np.ndarray:
    """Every sample's length in the dataset's global order.

    The count comes from ``index.json``: under a process group ``len(StreamingDataset)`` is this rank's shard,
    while ``dataset[i]`` takes a global index on every rank.
    """
    import litdata

    total = sum(chunk["chunk_size"] for chunk in json.loads((path / "index.json").read_text())["chunks"])
    dataset = litdata.StreamingDataset(str(path))
    return np.fromiter((dataset[i]["length"] for i in range(total)), dtype=np.int64, count=total)


def read_manifest(root: Path) -> dict | None:
    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def load_lengths(split_dir: Path) -> np.ndarray:
    path = split_dir / LENGTHS
    if not path.is_file():
        raise DataError(f"{split_dir} has no {LENGTHS}; delete the folder so prepare_data rebuilds it")
    return np.load(path)
