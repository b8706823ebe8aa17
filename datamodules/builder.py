"""Turning documents into a litdata dataset of token arrays, with a length index beside it.

Each sample is ``{"tokens": int32 array, "length": int}``. After ``litdata.optimize`` the lengths are read back
in the dataset's own global order into ``lengths.npy``: planners need every document's length on every rank
without touching the token data. A ``manifest.json`` records what the dataset was built from, so a data
module can tell whether an existing folder still matches its configuration.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import multiprocessing
import shutil
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path

import numpy as np

from sparsebalance_pl.datamodules.synthetic import LengthPrior, synthetic_document
from sparsebalance_pl.datamodules.tokenizer import Tokenizer, load_tokenizer
from sparsebalance_pl.errors import DataError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LENGTHS = "lengths.npy"
TEXT_SUFFIXES = (".txt", ".jsonl")
REAL_TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt")
"""What the ``installed`` source reads: source code and documentation, and plain-text files whose names end in no
suffix of letters (licences such as ``GPL-3`` or ``Apache-2.0``)."""
LICENSES = "/usr/share/common-licenses"


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
            raise DataError(f"data.corpus.text_dir={folder!r} does not exist or is not a folder")
        files = tuple(sorted(str(p) for p in root.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()))
        if not files:
            raise DataError(f"data.corpus.text_dir={folder!r} holds no {' or '.join(TEXT_SUFFIXES)} files")
        return cls(files)

    def describe(self) -> dict:
        """Each file's size and modification time, so a rebuild can say which files changed."""
        files = {}
        for name in self.files:
            stat = Path(name).stat()
            files[name] = f"{stat.st_size}:{stat.st_mtime_ns}"
        return {"kind": "folder", "files": files}


def default_real_text_roots() -> list[str]:
    """This interpreter's site-packages and the system's licence texts (where this system has them)."""
    paths = sysconfig.get_paths()
    return sorted({paths["purelib"], paths["platlib"]}) + ([LICENSES] if Path(LICENSES).is_dir() else [])


@dataclass(frozen=True)
class InstalledTextSource(FolderSource):
    """Real documents no one here wrote, one per file: the source and documentation of installed Python packages
    and plain-text files such as licences (``REAL_TEXT_SUFFIXES`` below ``roots``; packaging metadata, caches and
    binary files left out). Read like a folder source; code gives a real, heavy-tailed length distribution.

    Up to ``max_files`` files with distinct contents, taken in turn from each root's seeded shuffle of its sorted
    paths (so a small root of prose, such as the licences, is not drowned by thousands of source files, and every
    rank and run picks the same files), listed sorted."""

    @classmethod
    def scan(cls, roots: list[str], max_files: int, seed: int) -> "InstalledTextSource":
        rng = np.random.default_rng([seed, 104729])
        shuffled = []
        for root in sorted(set(roots)):
            files = sorted(str(p) for p in _real_text_files(root))
            shuffled.append([files[i] for i in rng.permutation(len(files))])
        picked, seen = [], set()
        for path in (p for turn in itertools.zip_longest(*shuffled) for p in turn if p is not None):
            if len(picked) == max_files:
                break
            try:
                content = Path(path).read_bytes()
            except OSError as err:
                log.warning("%s: skipped, cannot be read (%s)", path, err)
                continue
            digest = hashlib.sha256(content).digest()
            if b"\0" not in content and digest not in seen:  # a NUL byte: a binary file, not text
                seen.add(digest)
                picked.append(path)
        if not picked:
            raise DataError(f"data.corpus.roots={roots} hold no readable text file "
                            f"({', '.join(REAL_TEXT_SUFFIXES)} or without a suffix)")
        return cls(tuple(sorted(picked)))

    def describe(self) -> dict:
        return {**super().describe(), "kind": "installed"}


def _real_text_files(root: str) -> list[Path]:
    path = Path(root)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"data.corpus.roots: {root!r} does not exist")
    skipped = ("__pycache__", ".git")
    return [
        p for p in path.rglob("*")
        if (p.suffix in REAL_TEXT_SUFFIXES or not p.suffix[1:2].isalpha()) and p.is_file()
        and not any(part in skipped or part.endswith((".dist-info", ".egg-info")) for part in p.relative_to(path).parts)
    ]


def describe_changes(old: dict, new: dict) -> str:
    """What differs between two manifests, naming the files of a folder source that were added, removed or
    modified."""
    old_files = old.get("source", {}).get("files")
    new_files = new["source"].get("files")
    if not isinstance(old_files, dict) or not isinstance(new_files, dict):
        changed = sorted(k for k in new if old.get(k) != new[k])
        return f"settings changed: {', '.join(changed)}"
    parts = []
    for label, names in (
        ("added", sorted(set(new_files) - set(old_files))),
        ("removed", sorted(set(old_files) - set(new_files))),
        ("modified", sorted(n for n in set(old_files) & set(new_files) if old_files[n] != new_files[n])),
    ):
        if names:
            parts.append(f"{label}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")
    others = sorted(k for k in new if k != "source" and old.get(k) != new[k])
    if others:
        parts.append(f"settings changed: {', '.join(others)}")
    return "; ".join(parts) or "source changed"


def read_documents(path: str) -> Iterator[tuple[str, str]]:
    """(where, text) of each document of one text file (one per line of a ``.jsonl`` file, else the whole file),
    naming the file and line of anything unreadable."""
    file = Path(path)
    try:
        raw = file.read_bytes()
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        log.warning("%s: not valid UTF-8 at byte %d; undecodable bytes replaced", path, err.start)
        text = raw.decode("utf-8", errors="replace")
    if file.suffix != ".jsonl":
        yield path, text
        return
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            yield f"{path}:{line_no}", record["text"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            log.warning("%s:%d: skipped, not a JSON object with a 'text' field (%s)", path, line_no, err)


def _encode_chunks(
    text: str, tokenizer: Tokenizer, max_doc_tokens: int, oversize: str, where: str
) -> Iterator[dict]:
    """A document as samples of at most ``max_doc_tokens`` tokens (end-of-document token included).

    Empty documents are skipped and longer ones split or rejected (``oversize``), each reported with
    ``where`` (file and line) in the log.
    """
    ids = tokenizer.encode(text) + [tokenizer.eos_id]
    if len(ids) < 2 or not text.strip():
        log.warning("%s: empty document skipped", where)
        return
    if len(ids) > max_doc_tokens:
        action = "rejected" if oversize == "reject" else "split"
        log.warning("%s: document of %d tokens %s (data.corpus.max_doc_tokens=%d, data.corpus.oversize=%s)",
                    where, len(ids), action, max_doc_tokens, oversize)
        if oversize == "reject":
            return
    for start in range(0, len(ids), max_doc_tokens):
        piece = np.asarray(ids[start : start + max_doc_tokens], dtype=np.int32)
        if piece.size >= 2:
            yield {"tokens": piece, "length": int(piece.size)}


@lru_cache(maxsize=4)
def _tokenizer(spec: str) -> Tokenizer:
    """One tokenizer per build process: a Hugging Face one takes about 0.3 s to load, longer than most files
    take to encode."""
    return load_tokenizer(spec)


def _synthetic_sample(item: tuple[int, int, int], tokenizer_spec: str, max_doc_tokens: int) -> Iterator[dict]:
    seed, index, num_tokens = item
    rng = np.random.default_rng([seed, index])
    tokenizer = _tokenizer(tokenizer_spec)
    # The byte tokenizer makes one token per character; other tokenizers are cut to length after encoding.
    text = synthetic_document(rng, num_tokens - 1)
    yield from _encode_chunks(text, tokenizer, max_doc_tokens, "split", f"synthetic document {index}")


def _folder_samples(path: str, tokenizer_spec: str, max_doc_tokens: int, oversize: str) -> Iterator[dict]:
    tokenizer = _tokenizer(tokenizer_spec)
    for where, text in read_documents(path):
        yield from _encode_chunks(text, tokenizer, max_doc_tokens, oversize, where)


def _split(items: list, val_fraction: float, seed: int) -> tuple[list, list]:
    rng = np.random.default_rng([seed, 7919])
    is_val = rng.random(len(items)) < val_fraction
    if len(items) > 1 and val_fraction > 0 and not is_val.any():
        is_val[-1] = True
    return [x for x, v in zip(items, is_val) if not v], [x for x, v in zip(items, is_val) if v]


def source_file_splits(manifest: dict) -> tuple[list[str], list[str]]:
    """(train files, val files) of a corpus built from files, divided as ``build_splits`` divided them, read off
    its manifest: a study of held-out text learns which files a split holds without building anything. A
    synthetic corpus, which has no files, raises ``DataError``."""
    source = manifest["source"]
    if not source.get("files"):
        raise DataError(f"a {source['kind']} corpus lists no source files in its {MANIFEST}")
    return _split(list(source["files"]), manifest["val_fraction"], source.get("seed", 0))


def source_documents(path: str, manifest: dict) -> Iterator[dict]:
    """The documents ``build_splits`` made of the source file ``path`` under the manifest's tokenizer, length and
    oversize settings, so a study can match a corpus's documents to the files they came from."""
    return _folder_samples(path, manifest["tokenizer"], manifest["max_doc_tokens"], manifest.get("oversize", "split"))


def build_splits(
    out_dir: str,
    source: SyntheticSource | FolderSource,
    *,
    tokenizer_spec: str,
    max_doc_tokens: int,
    val_fraction: float,
    num_workers: int = 1,
    oversize: str = "split",
) -> None:
    """Build ``out_dir/train`` and ``out_dir/val`` (none when ``val_fraction`` is 0) unless they exist and
    match this configuration; a folder built from other files or settings is rebuilt, saying what changed."""
    manifest = {
        "source": source.describe(),
        "tokenizer": tokenizer_spec,
        "max_doc_tokens": max_doc_tokens,
        "val_fraction": val_fraction,
        "oversize": oversize,
    }
    root = Path(out_dir)
    previous = read_manifest(root)
    if previous == manifest:
        return
    if root.exists():
        reason = describe_changes(previous, manifest) if previous else "no manifest"
        log.warning("rebuilding %s since it was built (%s)", root, reason)
        shutil.rmtree(root)
    if isinstance(source, SyntheticSource):
        rng = np.random.default_rng(source.seed)
        lengths = LengthPrior.load(source.length_distribution).sample(source.num_documents, rng, max_doc_tokens)
        items = [(source.seed, i, int(n)) for i, n in enumerate(lengths)]
        fn: Callable = partial(_synthetic_sample, tokenizer_spec=tokenizer_spec, max_doc_tokens=max_doc_tokens)
    else:
        items = list(source.files)
        fn = partial(_folder_samples, tokenizer_spec=tokenizer_spec, max_doc_tokens=max_doc_tokens, oversize=oversize)
    train_items, val_items = _split(items, val_fraction, getattr(source, "seed", 0))
    _optimize(fn, train_items, root / "train", num_workers)
    if val_fraction > 0:
        _optimize(fn, val_items, root / "val", num_workers)
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _optimize(fn: Callable, items: list, out: Path, num_workers: int) -> None:
    import litdata

    if not items:
        raise DataError(f"no documents for {out}: the source is too small for a train and a validation split")
    start_method = multiprocessing.get_start_method(allow_none=True)
    try:
        litdata.optimize(
            fn=fn,
            inputs=items,
            output_dir=str(out),
            chunk_bytes="32MB",
            num_workers=max(1, min(num_workers, len(items))),
            verbose=False,
        )
    finally:  # litdata sets the whole process's start method to spawn; the caller's processes keep theirs
        multiprocessing.set_start_method(start_method, force=True)
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

    chunks = json.loads((path / "index.json").read_text())["chunks"]
    dataset = litdata.StreamingDataset(str(path))
    lengths, index = [], 0
    for chunk in chunks:
        for _ in range(chunk["chunk_size"]):
            try:
                sample = dataset[index]
                if sample["length"] != len(sample["tokens"]):
                    raise ValueError(f"length {sample['length']} != {len(sample['tokens'])} tokens")
            except Exception as err:  # litdata raises many kinds on damaged chunks
                raise DataError(
                    f"{path / chunk['filename']}: sample {index} cannot be read ({type(err).__name__}: {err}); "
                    f"the chunk is corrupt or truncated: delete {path.parent} so prepare_data rebuilds it"
                ) from err
            lengths.append(sample["length"])
            index += 1
    return np.asarray(lengths, dtype=np.int64)


def read_manifest(root: Path) -> dict | None:
    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def load_lengths(split_dir: Path) -> np.ndarray:
    """The split's document lengths, after checking that every chunk file is there whole."""
    path = split_dir / LENGTHS
    if not path.is_file():
        raise DataError(f"{split_dir} has no {LENGTHS}; delete {split_dir.parent} so prepare_data rebuilds it")
    verify_chunks(split_dir)
    return np.load(path)


def verify_chunks(split_dir: Path) -> None:
    """Every chunk named in litdata's ``index.json`` exists with the size the index records and a header that
    fits it. Reads the headers only: a damaged header otherwise fails every read of the chunk with an error
    that names no file."""
    for chunk in json.loads((split_dir / "index.json").read_text())["chunks"]:
        file = split_dir / chunk["filename"]
        size = file.stat().st_size if file.is_file() else None
        if size != chunk["chunk_bytes"]:
            problem = "missing" if size is None else f"{size} bytes, expected {chunk['chunk_bytes']}"
        else:
            problem = _chunk_header_problem(file, chunk["chunk_size"], size)
        if problem:
            raise DataError(
                f"{file}: chunk {problem} (truncated or corrupt); delete {split_dir.parent} so prepare_data "
                "rebuilds it"
            )


def _chunk_header_problem(file: Path, items: int, size: int) -> str | None:
    """What is wrong with an uncompressed litdata chunk's header: its item count, then the byte offset of each
    item and of the end of the last, rising from the end of the header to at most the file's size."""
    header = np.fromfile(file, dtype="<u4", count=items + 2).astype(np.int64)
    if header.size < items + 2 or header[0] != items:
        return f"header does not hold the {items} items index.json records"
    offsets = header[1:]
    if offsets[0] != 4 * (items + 2) or offsets[-1] > size or np.any(np.diff(offsets) < 0):
        return "header's item offsets do not fit the file"
    return None
