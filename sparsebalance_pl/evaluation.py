"""Scoring model answers: teacher-forced exact match of planted answers, and generated answers against
LongBench-style references (QA F1 and exact match), without materialising the full logits."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def greedy_tokens(hidden: torch.Tensor, head_weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The most likely next token at each of ``positions`` [n] of hidden states [T, H]: only those rows go
    through the LM head."""
    return (hidden[positions] @ head_weight.to(hidden.dtype).T).argmax(dim=-1)


def answer_exact_match(
    hidden: torch.Tensor, head_weight: torch.Tensor, input_ids: torch.Tensor, answer_spans: torch.Tensor
) -> torch.Tensor:
    """Whether greedy next-token prediction reproduces each answer, bool [n].

    hidden [T, H] are the final hidden states of one packed stream, ``input_ids`` [T] its tokens and
    ``answer_spans`` [n, 2] the answers as stream positions [start, end).
    """
    sizes = (answer_spans[:, 1] - answer_spans[:, 0]).tolist()
    if not sizes:
        return torch.zeros(0, dtype=torch.bool, device=hidden.device)
    positions = torch.cat([torch.arange(s - 1, e - 1, device=hidden.device) for s, e in answer_spans.tolist()])
    right = greedy_tokens(hidden, head_weight, positions) == input_ids[positions + 1]
    return torch.stack([chunk.all() for chunk in torch.split(right, sizes)])


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
