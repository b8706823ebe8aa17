"""A built-in long-context corpus: haystacks of text with retrieval tasks planted in them.

Document lengths follow a real long-context length distribution (``LengthPrior``, from the quantile tables in
``sparsebalance_pl/resources``) scaled to the configured maximum. Each document is filler text from a small
grammar with needles planted at random depths (a pass key, key-value pairs) and, at its end, the questions
and their answers: predicting the answer tokens needs attention back to the needle, so long-range attention
matters and a trained model's attention becomes sharp. The same needles make the evaluation tasks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from sparsebalance_pl.errors import ConfigError

_ADJECTIVES = "quiet bright old green small heavy warm cold gentle distant golden hidden silver simple".split()
_NOUNS = "river garden city forest teacher window mountain village engine market harbor library bridge".split()
_VERBS = "watches follows crosses builds paints remembers visits carries finds shapes guards opens".split()
_PLACES = "at dawn|in the rain|near the sea|after the storm|before noon|under the stars|in winter".split("|")
_KEY_ALPHABET = np.array(list("abcdefghijklmnopqrstuvwxyz0123456789"))


class LengthPrior:
    """Inverse-CDF sampling of document lengths from a quantile table or a plain list of lengths."""

    BUILTIN = ("wlbllm", "prolong")

    def __init__(self, quantiles: np.ndarray, name: str) -> None:
        self.quantiles = np.asarray(quantiles, dtype=np.float64)
        self.name = name

    @classmethod
    def load(cls, spec: str) -> "LengthPrior":
        """``spec``: ``wlbllm``, ``prolong`` or a JSON file (a list of lengths, or a table with ``quantiles``)."""
        if spec in cls.BUILTIN:
            text = (resources.files("sparsebalance_pl") / "resources" / f"doclens_{spec}_quantiles.json").read_text()
        elif Path(spec).is_file():
            text = Path(spec).read_text()
        else:
            raise ConfigError(
                f"data.corpus.length_distribution={spec!r} is neither one of {list(cls.BUILTIN)} nor a JSON file"
            )
        data = json.loads(text)
        values = np.asarray(data["quantiles"] if isinstance(data, dict) else data, dtype=np.float64)
        if values.size < 2 or np.any(values <= 0):
            raise ConfigError(f"data.corpus.length_distribution={spec!r} must hold at least two positive lengths")
        if not isinstance(data, dict):
            values = np.quantile(values, np.linspace(0.0, 1.0, 1001))
        return cls(values, spec)

    def sample(self, n: int, rng: np.random.Generator, max_tokens: int, min_tokens: int = 32) -> np.ndarray:
        """``n`` lengths, scaled so that the distribution's 99th percentile lands on ``max_tokens``, then clipped.

        Scaling by the 99th percentile rather than the maximum keeps the shape of the bulk (a few documents
        near the maximum, most far shorter), which is what makes packing unbalanced.
        """
        grid = np.linspace(0.0, 1.0, self.quantiles.size)
        raw = np.interp(rng.random(n), grid, self.quantiles)
        scale = max_tokens / np.interp(0.99, grid, self.quantiles)
        return np.clip(np.rint(raw * scale), min_tokens, max_tokens).astype(np.int64)


@dataclass(frozen=True)
class Needle:
    """A fact planted in a haystack and the question that retrieves it."""

    fact: str
    question: str
    answer: str


def passkey_needle(rng: np.random.Generator) -> Needle:
    key = str(rng.integers(10_000, 100_000))
    return Needle(
        fact=f"The pass key is {key}. Remember it. {key} is the pass key. ",
        question="What is the pass key? The pass key is",
        answer=f" {key}.",
    )


def key_value_needle(rng: np.random.Generator) -> Needle:
    key = "".join(rng.choice(_KEY_ALPHABET, 4))
    value = "".join(rng.choice(_KEY_ALPHABET, 6))
    return Needle(
        fact=f"The value of key {key} is {value}. ",
        question=f"What is the value of key {key}? The value of key {key} is",
        answer=f" {value}.",
    )


def filler(rng: np.random.Generator, num_chars: int) -> str:
    """Grammatical filler sentences of about ``num_chars`` characters."""
    sentences, size = [], 0
    while size < num_chars:
        s = (
            f"The {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} the "
            f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_PLACES)}. "
        )
        sentences.append(s)
        size += len(s)
    return "".join(sentences)[:num_chars]


def haystack(rng: np.random.Generator, num_chars: int, needles: list[Needle], ask: bool = True) -> str:
    """Filler of about ``num_chars`` characters with the needles' facts at random depths and, with ``ask``,
    their questions and answers at the end."""
    tail = "".join(f"{n.question}{n.answer} " for n in needles) if ask else ""
    body_chars = max(0, num_chars - len(tail) - sum(len(n.fact) for n in needles))
    body = filler(rng, body_chars)
    cuts = np.sort(rng.integers(0, len(body) + 1, len(needles)))
    pieces, previous = [], 0
    for cut, needle in zip(cuts, needles):
        cut = _sentence_start(body, cut)
        pieces += [body[previous:cut], needle.fact]
        previous = cut
    pieces += [body[previous:], tail]
    return "".join(pieces)


def _sentence_start(text: str, position: int) -> int:
    """The start of the sentence at or after ``position`` (so facts never split a sentence)."""
    found = text.find("The ", position)
    return len(text) if found < 0 else found


def synthetic_document(rng: np.random.Generator, num_chars: int) -> str:
    """One training document: more needles in longer documents, none in the very shortest."""
    needles: list[Needle] = []
    if num_chars >= 160:
        needles.append(passkey_needle(rng))
    needles += [key_value_needle(rng) for _ in range(min(8, num_chars // 512))]
    return haystack(rng, num_chars, needles)
