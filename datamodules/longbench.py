"""LongBench-format evaluation data read from local JSONL files, for users who have the data.

Each line is a JSON object with ``input`` (the question; may be empty), ``context``, ``answers`` (list of
strings), ``length`` and ``dataset``; other fields (``_id``, ``all_classes``, ``language``) are ignored.
Malformed lines are skipped and reported by file and line, so one bad line never stops a run; a file with no
usable line is an error. Prompts follow the usual LongBench layout (context, then question, then ``Answer:``)
and over-long ones are cut in the middle, as LongBench does, keeping the start of the context and the
question. Scores are aggregated per ``dataset`` and per dataset and LongBench-E length bucket of ``length``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from sparsebalance_pl.datamodules.tokenizer import Tokenizer
from sparsebalance_pl.errors import ConfigError, DataError

log = logging.getLogger(__name__)

#: LongBench-E's length buckets over the ``length`` field: (upper bound, name).
LENGTH_BUCKETS = ((4000, "0-4k"), (8000, "4-8k"), (float("inf"), "8k+"))


@dataclass(frozen=True)
class LongBenchRecord:
    """One usable line: what the prompt is built from, the reference answers and where it is scored."""

    context: str
    input: str
    answers: tuple[str, ...]
    length: int
    dataset: str

    @property
    def prompt(self) -> str:
        question = f"Question: {self.input}\n" if self.input.strip() else ""
        return f"{self.context}\n\n{question}Answer:"

    @property
    def bucket(self) -> str:
        return next(name for bound, name in LENGTH_BUCKETS if self.length < bound)


@rank_zero_only
def _report(message: str, *args) -> None:
    """Warn once per run, not once per rank (every rank reads the files)."""
    log.warning(message, *args)


def longbench_files(path: str) -> list[Path]:
    """The ``.jsonl`` file at ``path``, or every ``.jsonl`` file below that folder."""
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ConfigError(f"data.evaluation.longbench={path!r} does not exist (a .jsonl file or a folder of them)")
    files = sorted(p for p in root.rglob("*.jsonl") if p.is_file())
    if not files:
        raise ConfigError(f"data.evaluation.longbench={path!r} is a folder without .jsonl files")
    return files


def _record(line: bytes) -> LongBenchRecord:
    """The record on one line; ValueError saying what is wrong with it."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"not valid UTF-8 at byte {err.start}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"a JSON {type(obj).__name__}, not an object")
    missing = [k for k in ("input", "context", "answers", "length", "dataset") if k not in obj]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    if not all(isinstance(obj[k], str) for k in ("input", "context", "dataset")) or not obj["dataset"]:
        raise ValueError("input and context must be strings and dataset a non-empty string")
    answers = obj["answers"]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError("answers must be a non-empty list of strings")
    length = obj["length"]
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be a non-negative integer, not {length!r}")
    return LongBenchRecord(obj["context"], obj["input"], tuple(answers), length, obj["dataset"])


def read_file(path: Path) -> tuple[list[LongBenchRecord], int]:
    """(records, malformed lines skipped) of one file; blank lines are neither."""
    records, skipped = [], 0
    for line_no, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(_record(line))
        except ValueError as err:
            skipped += 1
            _report("%s:%d: skipped, %s", path, line_no, err)
    if not records:
        raise DataError(f"{path}: no valid LongBench line (each needs input, context, answers, length, dataset)")
    return records, skipped


def read_longbench(path: str) -> list[LongBenchRecord]:
    """Every usable record under ``path`` (``data.evaluation.longbench``), with the skipped lines counted per file."""
    records = []
    for file in longbench_files(path):
        found, skipped = read_file(file)
        records += found
        if skipped:
            _report("%s: %d malformed line(s) skipped, %d samples read", file, skipped, len(found))
    return records


def cell_names(records: list[LongBenchRecord]) -> tuple[list[str], np.ndarray]:
    """Score cells (each dataset, then each dataset@bucket) and each record's two cell indices [n, 2]."""
    keys = [(r.dataset, f"{r.dataset}@{r.bucket}") for r in records]
    names = sorted({d for d, _ in keys}) + sorted({c for _, c in keys})
    index = {name: i for i, name in enumerate(names)}
    return names, np.array([[index[d], index[c]] for d, c in keys], dtype=np.int64)


def truncate_middle(ids: list[int], max_tokens: int) -> list[int]:
    """``ids`` cut to ``max_tokens`` by dropping the middle (LongBench's convention)."""
    if len(ids) <= max_tokens:
        return ids
    head = max_tokens // 2
    return ids[:head] + ids[len(ids) - (max_tokens - head) :]


def make_prompts(records: list[LongBenchRecord], tokenizer: Tokenizer, max_prompt_tokens: int) -> list[dict]:
    """Samples ``{"tokens", "answers", "cells"}`` with prompts of at most ``max_prompt_tokens``; reports how
    many were truncated."""
    _, cells = cell_names(records)
    samples, truncated = [], 0
    for record, record_cells in zip(records, cells):
        ids = tokenizer.encode(record.prompt)
        truncated += len(ids) > max_prompt_tokens
        tokens = np.asarray(truncate_middle(ids, max_prompt_tokens), dtype=np.int32)
        samples.append({"tokens": tokens, "answers": record.answers, "cells": record_cells})
    if truncated:
        _report(
            "LongBench: %d of %d prompts longer than data.evaluation.longbench_max_tokens=%d were truncated in the middle",
            truncated, len(samples), max_prompt_tokens,
        )
    return samples


def collate_prompts(samples: list[dict]) -> dict:
    """Prompts to continue, with their references; padding samples (``bears_loss: False``) keep ranks in step
    while generating but are not scored."""
    return {
        "prompts": [s["tokens"].tolist() for s in samples],
        "answers": [s["answers"] for s in samples],
        "cells": torch.as_tensor(np.stack([s["cells"] for s in samples])),
        "scored": torch.tensor([s.get("bears_loss", True) for s in samples]),
    }
