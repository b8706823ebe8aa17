"""Evaluation apart from training: the test suites ``main.py test`` runs, and how they score answers.

Each suite scores the batches of its own test loader (the data module builds both, in the same order, and
tags each batch with its suite's index) through a few model operations (``Scorer``), and sums its metrics
over ranks: the synthetic retrieval tasks by teacher-forced exact match, LongBench-format prompts by greedy
generation scored with QA F1 and exact match."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from sparsebalance_pl.metrics import CellAccuracy, CellMeans


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def greedy_generate(
    next_tokens: Callable[[list[list[int]]], list[int]],
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    eos_id: int,
    stop: Callable[[bool], bool] = bool,
) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (end-of-text excluded), at most ``max_new_tokens`` each.

    ``next_tokens(sequences)`` returns each sequence's greedy next token from one forward over all of them: with
    no KV cache every new token costs a forward of the whole stream (prompts plus what was generated so far).
    Finished sequences stay in the stream so every call has the same documents. ``stop(all_finished)`` decides
    whether to end early; under data parallelism it must agree across ranks (every rank has to run the same
    number of forwards, or the collectives inside them wait forever).
    """
    generated: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    for _ in range(max_new_tokens):
        if stop(all(finished)):
            break
        predicted = next_tokens([list(p) + g for p, g in zip(prompts, generated)])
        for i, token in enumerate(predicted):
            if finished[i]:
                continue
            if token == eos_id:
                finished[i] = True
            else:
                generated[i].append(token)
    return generated


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles (a, an, the), single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def qa_f1(prediction: str, reference: str) -> float:
    """Token-level F1 of the normalised strings (two empty answers agree; one empty answer scores 0)."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not predicted or not expected:
        return float(predicted == expected)
    same = sum((Counter(predicted) & Counter(expected)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(expected)
    return 2 * precision * recall / (precision + recall)


def qa_scores(prediction: str, references: Sequence[str]) -> tuple[float, float]:
    """(F1, exact match) of ``prediction``, each the best over the reference answers."""
    normalised = normalize_answer(prediction)
    f1 = max(qa_f1(prediction, r) for r in references)
    exact = max(float(normalised == normalize_answer(r)) for r in references)
    return f1, exact


class Scorer(Protocol):
    """The model operations an evaluation needs (``SparseCausalLM`` implements them)."""

    device: torch.device

    def answers_correct(self, batch: dict) -> torch.Tensor:
        """bool [n]: whether greedy next-token prediction reproduces each of the batch's ``answer_spans``."""
        ...

    def greedy_next_tokens(self, sequences: list[list[int]]) -> list[int]:
        """Each sequence's greedy next token, from one forward of them all packed into one stream."""
        ...

    def all_ranks(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (the same answer everywhere)."""
        ...


class RetrievalEvaluation:
    """The synthetic long-context tasks: exact match of every answer token under teacher forcing, per (task,
    length) cell, summed over ranks. Logged as ``test/accuracy/<task>@<length>``."""

    def __init__(self, cells: Sequence[str]) -> None:
        self.cells = list(cells)
        self.accuracy: CellAccuracy | None = None

    def update(self, model: Scorer, batch: dict) -> None:
        if self.accuracy is None:
            self.accuracy = CellAccuracy(self.cells).to(model.device)
        self.accuracy.update(batch["cells"], model.answers_correct(batch))

    def compute(self) -> dict[str, torch.Tensor]:
        if self.accuracy is None:
            return {}
        scores = {f"test/accuracy/{cell}": value for cell, value in self.accuracy.compute().items()}
        self.accuracy = None
        return scores


class LongBenchEvaluation:
    """LongBench-format prompts: greedy answers scored by QA F1 and exact match against the references, per
    dataset and per dataset and length bucket, summed over ranks. Logged as
    ``test/longbench/{f1,exact_match}/<cell>``.

    Without a KV cache each new token is one forward of the whole packed micro-batch: up to ``max_new_tokens``
    forwards per micro-batch. Generation ends early only when every rank is done.
    """

    def __init__(self, cells: Sequence[str], tokenizer, max_new_tokens: int) -> None:
        self.cells = list(cells)
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.scores: CellMeans | None = None

    def update(self, model: Scorer, batch: dict) -> None:
        generated = greedy_generate(
            model.greedy_next_tokens, batch["prompts"], self.max_new_tokens, self.tokenizer.eos_id,
            stop=model.all_ranks,
        )
        scores = [qa_scores(self.tokenizer.decode(ids), answers) for ids, answers in zip(generated, batch["answers"])]
        if self.scores is None:
            self.scores = CellMeans(self.cells, ["f1", "exact_match"]).to(model.device)
        scored = batch["scored"]
        self.scores.update(batch["cells"][scored], torch.tensor(scores, device=model.device)[scored])

    def compute(self) -> dict[str, torch.Tensor]:
        if self.scores is None:
            return {}
        logged = {}
        for score, cells in self.scores.compute().items():
            logged |= {f"test/longbench/{score}/{cell}": value for cell, value in cells.items()}
        self.scores = None
        return logged


Evaluation = RetrievalEvaluation | LongBenchEvaluation
