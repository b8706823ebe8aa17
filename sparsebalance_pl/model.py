"""Qwen2 architectures by name, and building them from a preset, explicit dimensions or a local directory.

The model itself is Hugging Face's unmodified ``Qwen2ForCausalLM``; only its attention function is swapped
(see ``attention.py``). Nothing here touches the network: a pretrained model is read from a local
Hugging Face directory, and without one the weights are initialised randomly.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from sparsebalance_pl.attention import AttentionContext
from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.loss import chunked_cross_entropy_sum


@dataclass(frozen=True)
class ModelDims:
    """The dimensions that decide a Qwen2 model's size and cost (what the latency model keys on)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int | None = None  # None: hidden_size // num_heads
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} must be divisible by model.num_heads={self.num_heads} "
                "(or set model.head_dim)"
            )
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    def to_hf_config(self, attn_implementation: str | None = None) -> Qwen2Config:
        return Qwen2Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            use_cache=False,
            attn_implementation=attn_implementation,
        )

    @classmethod
    def from_hf_config(cls, config: Qwen2Config) -> "ModelDims":
        rope = getattr(config, "rope_parameters", None) or {}
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            head_dim=getattr(config, "head_dim", None),
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(config.tie_word_embeddings),
            rms_norm_eps=config.rms_norm_eps,
        )

    def as_dict(self) -> dict:
        return asdict(self)


#: Published architectures (Qwen2.5 technical report / the models' config.json files) and the CPU demo.
PRESETS: dict[str, ModelDims] = {
    "qwen2.5-0.5b": ModelDims(
        num_layers=24, hidden_size=896, num_heads=14, num_kv_heads=2, intermediate_size=4864, vocab_size=151936
    ),
    "qwen2.5-1.5b": ModelDims(
        num_layers=28, hidden_size=1536, num_heads=12, num_kv_heads=2, intermediate_size=8960, vocab_size=151936
    ),
    "qwen2.5-3b": ModelDims(
        num_layers=36, hidden_size=2048, num_heads=16, num_kv_heads=2, intermediate_size=11008, vocab_size=151936
    ),
    "demo": ModelDims(
        num_layers=4,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=768,
        vocab_size=512,
        max_position_embeddings=16384,
    ),
}


#: The overrides a pretrained model accepts: they extend its context without changing its weights' shapes.
CONTEXT_OVERRIDES = ("rope_theta", "max_position_embeddings")


@dataclass
class ModelConfig:
    """Which Qwen2 to train: a preset name, optionally overridden dimension by dimension, or a local checkpoint.

    Args:
        preset: one of ``PRESETS`` (ignored when ``pretrained_path`` is set).
        pretrained_path: a local Hugging Face model directory (config.json plus safetensors); its weights are
            loaded and its tokenizer can be used by the data module. Never downloaded.
        overrides: dimension overrides on top of the preset, e.g. ``{"num_layers": 2}``. On a pretrained
            model only those that keep its weights' shapes, for extending its context: ``rope_theta`` and
            ``max_position_embeddings``.
    """

    preset: str = "demo"
    pretrained_path: str | None = None
    overrides: dict | None = None

    def __post_init__(self) -> None:
        if self.pretrained_path is None and self.preset not in PRESETS:
            raise ConfigError(f"model.preset={self.preset!r} is unknown; allowed: {sorted(PRESETS)}")
        if self.pretrained_path is not None and not (Path(self.pretrained_path) / "config.json").is_file():
            raise ConfigError(
                f"model.pretrained_path={self.pretrained_path!r} is not a local Hugging Face model directory "
                "(no config.json there); weights are never downloaded"
            )
        allowed = set(ModelDims.__dataclass_fields__)
        unknown = set(self.overrides or {}) - allowed
        if unknown:
            raise ConfigError(f"model.overrides has unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        reshaping = set(self.overrides or {}) - set(CONTEXT_OVERRIDES)
        if self.pretrained_path is not None and reshaping:
            raise ConfigError(
                f"model.overrides {sorted(reshaping)} would change the shapes of the pretrained weights in "
                f"{self.pretrained_path}; a pretrained model takes only {list(CONTEXT_OVERRIDES)}"
            )

    def dims(self) -> ModelDims:
        if self.pretrained_path is not None:
            base = ModelDims.from_hf_config(Qwen2Config.from_pretrained(self.pretrained_path))
        else:
            base = PRESETS[self.preset]
        return replace(base, **(self.overrides or {}))

    def build(self, attn_implementation: str, device: torch.device | str | None = None) -> Qwen2ForCausalLM:
        """Build the model with the given registered attention implementation, on ``device``."""
        if self.pretrained_path is not None:
            config = Qwen2Config.from_pretrained(self.pretrained_path)
            overrides = self.overrides or {}
            if "max_position_embeddings" in overrides:
                config.max_position_embeddings = overrides["max_position_embeddings"]
            if "rope_theta" in overrides:
                config.rope_parameters = {**(config.rope_parameters or {}), "rope_theta": overrides["rope_theta"]}
            model = Qwen2ForCausalLM.from_pretrained(
                self.pretrained_path,
                config=config,
                attn_implementation=attn_implementation,
                torch_dtype=torch.float32,
                local_files_only=True,
            ).train()  # from_pretrained returns eval mode; a fresh model (and Lightning) expects train mode
            return model.to(device) if device is not None else model
        config = self.dims().to_hf_config(attn_implementation)
        with torch.device(device) if device is not None else nullcontext():
            return Qwen2ForCausalLM(config)


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


class PackedCausalLM(nn.Module):
    """Qwen2 backbone and LM head computing the summed loss of one packed stream.

    This is the FSDP root: calling the backbone and the head inside one forward keeps the tied
    embedding/head weight gathered for both.
    """

    def __init__(self, hf_model: nn.Module, loss_chunk_tokens: int) -> None:
        super().__init__()
        self.hf = hf_model
        self.loss_chunk_tokens = loss_chunk_tokens

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        targets: torch.Tensor,
        ctx: AttentionContext,
        answer_spans: torch.Tensor | None = None,
        predict_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """(summed loss, loss-bearing tokens); with ``answer_spans``, whether each answer is predicted; with
        ``predict_at``, the greedy next token at each of those stream positions."""
        hidden = self.hf.model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, sb_context=ctx
        ).last_hidden_state
        if answer_spans is not None:
            return answer_exact_match(hidden[0], self.hf.lm_head.weight, input_ids[0], answer_spans)
        if predict_at is not None:
            return greedy_tokens(hidden[0], self.hf.lm_head.weight, predict_at)
        return chunked_cross_entropy_sum(hidden[0], self.hf.lm_head.weight, targets[0], self.loss_chunk_tokens)
