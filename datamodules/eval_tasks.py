"""Long-context retrieval tasks generated locally, scored by exact match of the answer tokens.

Three tasks at several context lengths:

- ``passkey``: one pass key hidden in filler text;
- ``multikey_niah``: several named pass keys (distractors), the question asks for one of them;
- ``kv_retrieval``: many key-value pairs, the question asks for one value.

A sample is ``{"tokens", "answer_start", "task", "length", "cell"}``: the context and question, then the answer tokens
from ``answer_start`` on. The answer is right when the model's greedy next-token prediction reproduces every
answer token given the tokens before it (teacher forcing), which is exactly when greedy decoding would produce
the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsebalance_pl.datamodules.synthetic import Needle, haystack, key_value_needle, passkey_needle
from sparsebalance_pl.datamodules.tokenizer import Tokenizer
from sparsebalance_pl.errors import ConfigError

TASKS = ("passkey", "multikey_niah", "kv_retrieval")
_NAMES = "alice bob carol dave erin frank grace heidi ivan judy".split()


def _named_key_needle(rng: np.random.Generator, name: str) -> Needle:
    key = str(rng.integers(10_000, 100_000))
    return Needle(
        fact=f"The pass key of {name} is {key}. ",
        question=f"What is the pass key of {name}? The pass key of {name} is",
        answer=f" {key}.",
    )


def _needles(task: str, rng: np.random.Generator, num_chars: int) -> tuple[list[Needle], Needle]:
    """(facts to plant, the one asked about)."""
    if task == "passkey":
        needle = passkey_needle(rng)
        return [needle], needle
    if task == "multikey_niah":
        names = rng.choice(_NAMES, size=4, replace=False)
        needles = [_named_key_needle(rng, str(n)) for n in names]
        return needles, needles[int(rng.integers(len(needles)))]
    pairs = [key_value_needle(rng) for _ in range(int(np.clip(num_chars // 256, 4, 32)))]
    return pairs, pairs[int(rng.integers(len(pairs)))]


@dataclass(frozen=True)
class EvalConfig:
    """Which synthetic tasks, at which context lengths (tokens), with how many samples each."""

    tasks: tuple[str, ...] = TASKS
    lengths: tuple[int, ...] = (512, 1024, 2048, 4096)
    samples_per_cell: int = 16
    seed: int = 1234

    @property
    def cells(self) -> list[str]:
        """Names of the (task, length) cells, in the order of the samples' ``cell`` index."""
        return [f"{task}@{length}" for task in self.tasks for length in self.lengths]

    def __post_init__(self) -> None:
        unknown = set(self.tasks) - set(TASKS)
        if unknown:
            raise ConfigError(f"data.evaluation.tasks has unknown tasks {sorted(unknown)}; allowed: {list(TASKS)}")
        if not self.lengths or min(self.lengths) < 128:
            raise ConfigError(f"data.evaluation.lengths={list(self.lengths)} must be context lengths of at least 128")
        if self.samples_per_cell < 1:
            raise ConfigError(f"data.evaluation.samples_per_cell={self.samples_per_cell} must be at least 1")


def make_eval_samples(config: EvalConfig, tokenizer: Tokenizer) -> list[dict]:
    """Every (task, length) cell's samples, deterministic in ``config.seed``; lengths are in tokens."""
    probe = haystack(np.random.default_rng(0), 4000, [])
    chars_per_token = len(probe) / len(tokenizer.encode(probe))
    samples = []
    for t, task in enumerate(config.tasks):
        for length in config.lengths:
            for i in range(config.samples_per_cell):
                rng = np.random.default_rng([config.seed, t, length, i])
                sample = _sample(task, length, rng, tokenizer, chars_per_token)
                samples.append({**sample, "cell": len(samples) // config.samples_per_cell})
    return samples


def _sample(task: str, length: int, rng: np.random.Generator, tokenizer: Tokenizer, chars_per_token: float) -> dict:
    facts, asked = _needles(task, rng, int(length * chars_per_token))
    answer_ids = tokenizer.encode(asked.answer)
    question_ids = tokenizer.encode(" " + asked.question)
    budget = length - len(answer_ids) - len(question_ids)
    num_chars = int(budget * chars_per_token)
    while True:  # token counts of other tokenizers are only estimated from characters: shrink until it fits
        context_ids = tokenizer.encode(haystack(rng, num_chars, facts, ask=False).rstrip())
        if len(context_ids) <= budget:
            break
        if num_chars < sum(len(f.fact) for f in facts):
            raise ConfigError(f"{task} at length {length}: the needles alone do not fit; use longer eval lengths")
        num_chars = int(num_chars * 0.95)
    tokens = np.asarray(context_ids + question_ids + answer_ids, dtype=np.int32)
    return {
        "tokens": tokens,
        "answer_start": len(tokens) - len(answer_ids),
        "task": task,
        "length": length,
    }
