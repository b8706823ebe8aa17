"""Causal language models of any Hugging Face family whose attention goes through transformers' AttentionInterface.

The model itself is transformers' own, unmodified; only its attention function is swapped (see ``attention.py``).
It is built from a published preset, from a family (``model_type``) and dimensions, or from a local Hugging Face
directory. Nothing here touches the network: a pretrained model is read from a local directory, and without one
the weights are initialised randomly. What packed, block-sparse training cannot represent (an architecture that
does not attend through the interface, layers that carry state across documents, attention or logits the
plug-in and the chunked loss would silently change) is refused with one line naming the architecture.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.modeling_layers import GradientCheckpointingLayer

from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.loss import chunked_cross_entropy_sum

__all__ = [
    "CONTEXT_OVERRIDES", "PRESETS", "ModelConfig", "ModelDims", "PackedCausalLM", "Preset", "answer_exact_match",
    "architecture_name", "build_model", "check_architecture", "check_model", "decoder_layers", "greedy_tokens",
]


@dataclass(frozen=True)
class ModelDims:
    """The dimensions that decide a model's size and cost (what the latency model keys on), in any family."""

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

    def to_hf_config(self, model_type: str = "qwen2", rope_scaling: dict | None = None) -> PretrainedConfig:
        """A randomly initialisable configuration of family ``model_type`` with these dimensions.

        Special-token ids the family's defaults place outside this vocabulary are cleared, and a sliding window
        is widened to the whole context: a new model attends to every earlier token of its document, which is
        what the sparse attention computes.
        """
        try:
            family = AutoConfig.for_model(model_type)
        except ValueError:
            raise ConfigError(f"model.model_type={model_type!r} is not a model family transformers knows") from None
        tokens = {name: None for name in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if isinstance(getattr(family, name, None), int) and getattr(family, name) >= self.vocab_size}
        config = AutoConfig.for_model(
            model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            use_cache=False,
            **tokens,
        )
        _set_rope(config, self.rope_theta, rope_scaling)
        if getattr(config, "sliding_window", None) is not None:
            config.sliding_window = self.max_position_embeddings
        return config

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> ModelDims:
        """The dimensions of a configuration of any family (the attribute names transformers' families share)."""
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            head_dim=getattr(config, "head_dim", None),
            rope_theta=float(_rope(config).get("rope_theta", 10000.0)),
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(config.tie_word_embeddings),
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        )

    def as_dict(self) -> dict:
        return asdict(self)


def _rope(config: PretrainedConfig) -> dict:
    """The rotary settings of the layers that attend over the whole context (families with a setting per layer
    type, as Gemma 3, keep them under ``full_attention``)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return rope.get("full_attention", rope)


def _set_rope(config: PretrainedConfig, theta: float, scaling: dict | None = None) -> None:
    """Set the rotary base (and scaling) of the layers that attend over the whole context."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if isinstance(rope.get("full_attention"), dict):
        rope["full_attention"] = {**rope["full_attention"], **(scaling or {}), "rope_theta": theta}
    else:
        rope = {"rope_type": "default", **rope, **(scaling or {}), "rope_theta": theta}
    config.rope_parameters = rope


@dataclass(frozen=True)
class Preset:
    """A published model: its family (transformers' ``model_type``), its dimensions, and the rotary scaling of
    its ``config.json`` where it has one."""

    model_type: str
    dims: ModelDims
    rope_scaling: dict | None = None


def _qwen25(num_layers: int, hidden_size: int, num_heads: int, intermediate_size: int) -> Preset:
    return Preset("qwen2", ModelDims(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                                     num_kv_heads=2, intermediate_size=intermediate_size, vocab_size=151936))


#: Published architectures (the models' config.json files) and the CPU demo.
PRESETS: dict[str, Preset] = {
    "qwen2.5-0.5b": _qwen25(24, 896, 14, 4864),
    "qwen2.5-1.5b": _qwen25(28, 1536, 12, 8960),
    "qwen2.5-3b": _qwen25(36, 2048, 16, 11008),
    "qwen3-0.6b": Preset("qwen3", ModelDims(
        num_layers=28, hidden_size=1024, num_heads=16, num_kv_heads=8, intermediate_size=3072, vocab_size=151936,
        head_dim=128, max_position_embeddings=40960,
    )),
    "llama3.2-1b": Preset(
        "llama",
        ModelDims(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, intermediate_size=8192,
                  vocab_size=128256, head_dim=64, rope_theta=500000.0, max_position_embeddings=131072,
                  rms_norm_eps=1e-5),
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "demo": Preset("qwen2", ModelDims(
        num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=768, vocab_size=512,
        max_position_embeddings=16384,
    )),
}

#: The overrides a pretrained model accepts: they extend its context without changing its weights' shapes.
CONTEXT_OVERRIDES = ("rope_theta", "max_position_embeddings")
#: Layer kinds whose tokens see nothing but attention over their own document (a sliding window only where it
#: cannot bind, ``check_architecture``).
ATTENTION_LAYERS = ("full_attention", "sliding_attention")
#: What families' heads do to the logits beyond the head's matrix (a configuration field and the value at which it
#: does nothing): the chunked loss multiplies by the head's weight alone.
LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


def architecture_name(config: PretrainedConfig) -> str:
    """How messages name an architecture: its family and transformers' causal-LM class."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return f"{config.model_type!r} ({model_class.__name__ if model_class else 'no causal LM class'})"


def check_architecture(config: PretrainedConfig) -> None:
    """Refuse, in one line naming the architecture, what packed block-sparse training cannot represent: it
    would otherwise leak across documents or silently compute another model than the one configured."""
    problem = _unsupported(config)
    if problem is not None:
        raise ConfigError(f"model {architecture_name(config)} cannot be trained here: {problem}")


def _unsupported(config: PretrainedConfig) -> str | None:
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None:
        return "transformers has no causal language model for it"
    if not model_class.is_backend_compatible():
        return "its attention does not go through transformers' AttentionInterface"
    layer_types = getattr(config, "layer_types", None)
    kinds = sorted(set(layer_types or ()) - set(ATTENTION_LAYERS))
    if kinds:
        return f"its {', '.join(kinds)} layers carry state across the documents packed into a stream"
    window, context = getattr(config, "sliding_window", None), config.max_position_embeddings
    windowed = "sliding_attention" in layer_types if layer_types else True  # without layer types: every layer
    if window is not None and window < context and windowed:
        return (f"its sliding window of {window} tokens is shorter than its context of {context}, and the sparse "
                "attention attends over whole documents")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "it soft-caps attention logits, which the sparse attention does not"
    for name in ("attention_dropout", "attn_pdrop"):
        if float(getattr(config, name, 0.0) or 0.0) > 0:
            return f"it drops attention weights in training ({name} > 0), which the sparse attention does not"
    for name, neutral in LOGIT_TRANSFORMS.items():
        value = getattr(config, name, None)
        if value is not None and value != neutral:
            return f"it transforms its logits after the head ({name}={value}), which the chunked loss does not"
    return None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers causal LM (the modules transformers recomputes under activation
    checkpointing), each an FSDP2 unit."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ConfigError(f"model {architecture_name(model.config)} has no decoder layers transformers can recompute")
    return layers


def build_model(config: PretrainedConfig, attn_implementation: str, device: torch.device | str | None = None):
    """A randomly initialised causal LM of ``config`` attending through ``attn_implementation``, on ``device``."""
    check_architecture(config)
    with torch.device(device) if device is not None else nullcontext():
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                 dtype=torch.float32)
    check_model(model)
    return model


def check_model(model: nn.Module) -> None:
    """``check_architecture`` of a built model, and what only the built model shows: the chunked loss needs an LM
    head that is one weight matrix without a bias."""
    check_architecture(model.config)
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ConfigError(f"model {architecture_name(model.config)} cannot be trained here: the chunked loss needs "
                          "an LM head that is one weight matrix without a bias")


@dataclass
class ModelConfig:
    """Which causal LM to train: a preset, a family and dimensions, or a local checkpoint.

    Args:
        preset: one of ``PRESETS`` (ignored when ``pretrained_path`` is set): the family and dimensions to start
            from.
        model_type: the family (transformers' ``model_type``: ``qwen2``, ``qwen3``, ``llama``, ``mistral``,
            ``gemma3_text``, ``phi3``, ...) for a randomly initialised model with the preset's dimensions and
            ``overrides``; default: the preset's own.
        pretrained_path: a local Hugging Face model directory (config.json plus safetensors) of any supported
            family; its weights are loaded and its tokenizer can be used by the data module. Never downloaded.
        overrides: dimension overrides (``ModelDims`` fields) on top of the preset, e.g. ``{"num_layers": 2}``.
            On a pretrained model only those that keep its weights' shapes, for extending its context:
            ``rope_theta`` and ``max_position_embeddings``.
    """

    preset: str = "demo"
    model_type: str | None = None
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
        if self.pretrained_path is not None and self.model_type is not None:
            raise ConfigError(f"model.model_type={self.model_type!r} is for a new model; a pretrained one's family "
                              f"is the model_type of {self.pretrained_path}/config.json")
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
        check_architecture(self.hf_config())

    def hf_config(self) -> PretrainedConfig:
        """The Hugging Face configuration of the model, overrides applied, without a KV cache (training)."""
        overrides = self.overrides or {}
        if self.pretrained_path is None:
            preset = PRESETS[self.preset]
            dims = replace(preset.dims, **overrides)
            return dims.to_hf_config(self.model_type or preset.model_type, preset.rope_scaling)
        config = AutoConfig.from_pretrained(self.pretrained_path, local_files_only=True)
        config.use_cache = False
        if "max_position_embeddings" in overrides:
            config.max_position_embeddings = overrides["max_position_embeddings"]
        if "rope_theta" in overrides:
            _set_rope(config, overrides["rope_theta"])
        return config

    def dims(self) -> ModelDims:
        return ModelDims.from_hf_config(self.hf_config())

    def build(self, attn_implementation: str, device: torch.device | str | None = None) -> nn.Module:
        """Build the model with the given registered attention implementation, on ``device``."""
        if self.pretrained_path is None:
            return build_model(self.hf_config(), attn_implementation, device)
        model = AutoModelForCausalLM.from_pretrained(
            self.pretrained_path,
            config=self.hf_config(),
            attn_implementation=attn_implementation,
            dtype=torch.float32,
            local_files_only=True,
        ).train()  # from_pretrained returns eval mode; a fresh model (and Lightning) expects train mode
        check_model(model)
        return model.to(device) if device is not None else model


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
    """A causal LM's decoder and head computing the summed loss of one packed stream.

    This is the FSDP root: calling the decoder and the head inside one forward keeps a tied embedding/head
    weight gathered for both.
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
        sparse_attention,
        answer_spans: torch.Tensor | None = None,
        predict_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """(summed loss, loss-bearing tokens); with ``answer_spans``, whether each answer is predicted; with
        ``predict_at``, the greedy next token at each of those stream positions. ``sparse_attention``: the
        ``SparseAttention`` every layer attends through, its micro-batch begun."""
        hidden = self.hf.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, sparse_attention=sparse_attention
        ).last_hidden_state
        head = self.hf.get_output_embeddings().weight
        if answer_spans is not None:
            return answer_exact_match(hidden[0], head, input_ids[0], answer_spans)
        if predict_at is not None:
            return greedy_tokens(hidden[0], head, predict_at)
        return chunked_cross_entropy_sum(hidden[0], head, targets[0], self.loss_chunk_tokens)
