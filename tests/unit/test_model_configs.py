"""The shipped configurations describe the published architectures, built on the meta device; families that
packed sparse training cannot represent are refused in one line naming the architecture."""

import re

import pytest
import torch
import yaml
from main_runner import REPO
from transformers import AutoConfig, AutoModelForCausalLM

from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.model import ModelConfig, ModelDims, check_architecture

CONFIGS = REPO / "configs"
#: The fields of the models' published config.json files that decide their architecture.
PUBLISHED = {
    "llama3_1b.yaml": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False, bos_token_id=128000, eos_token_id=128001,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "qwen3_0_6b.yaml": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=True, attention_bias=False, rope_theta=1000000.0, rope_scaling=None, sliding_window=None,
        use_sliding_window=False, max_window_layers=28,
    ),
}


def _meta_model(config_file: str) -> tuple[ModelConfig, torch.nn.Module]:
    cfg = yaml.safe_load((CONFIGS / config_file).read_text())
    model_config = ModelConfig(**cfg["model"]["model"])
    return model_config, model_config.build("sdpa", device="meta")


@pytest.mark.parametrize(
    "config_file, parameters",
    [("qwen05b.yaml", 494_032_768), ("qwen3b.yaml", 3_085_938_688), ("llama3_1b.yaml", 1_235_814_400),
     ("qwen3_0_6b.yaml", 596_049_920)],
)
def test_published_parameter_counts(config_file, parameters):
    _, model = _meta_model(config_file)
    assert sum(p.numel() for p in model.parameters()) == parameters  # tied embeddings counted once
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("config_file", sorted(PUBLISHED))
def test_new_families_are_transformers_own_model_of_the_published_config(config_file):
    """The configuration builds the same model, parameter by parameter, as transformers builds from the published
    config.json; the rotary settings (Llama 3's scaling) and the training method (SAB and DST) come with it."""
    model_config, ours = _meta_model(config_file)
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**PUBLISHED[config_file]))
    assert type(ours) is type(theirs)
    assert {n: p.shape for n, p in ours.named_parameters()} == {n: p.shape for n, p in theirs.named_parameters()}
    assert ours.config.rope_parameters == theirs.config.rope_parameters
    cfg = yaml.safe_load((CONFIGS / config_file).read_text())
    callbacks = {c["class_path"].rsplit(".", 1)[-1] for c in cfg["trainer"]["callbacks"]}
    assert {"DynamicSparsityTuning", "BatchPlanMonitor", "DensityCalibration"} <= callbacks
    assert cfg["data"]["batching"].get("method", "sab") == "sab" and cfg["model"]["attention"]["backend"] == "sparse"
    assert model_config.dims().max_position_embeddings >= cfg["data"]["corpus"]["max_doc_tokens"]


def test_qwen05b_architecture():
    model_config, model = _meta_model("qwen05b.yaml")
    hf = model.config
    assert (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads) == (24, 896, 14, 2)
    assert (hf.intermediate_size, hf.vocab_size, hf.tie_word_embeddings) == (4864, 151936, True)
    assert hf.rope_parameters["rope_theta"] == 1e6
    cfg = yaml.safe_load((CONFIGS / "qwen05b.yaml").read_text())
    assert cfg["trainer"]["strategy"]["class_path"].endswith("FSDP2Strategy")
    assert cfg["model"]["attention"]["backend"] == "sparse"


def test_qwen3b_512k_trains_512k_documents_across_the_gpus_of_a_node():
    from sparsebalance_pl.context_parallel import context_parallel_groups

    model_config, model = _meta_model("qwen3b_512k.yaml")
    assert sum(p.numel() for p in model.parameters()) == 3_085_938_688
    assert model.config.max_position_embeddings == 524288
    cfg = yaml.safe_load((CONFIGS / "qwen3b_512k.yaml").read_text())
    trainer, data = cfg["trainer"], cfg["data"]
    size = trainer["strategy"]["init_args"]["context_parallel_size"]
    groups = context_parallel_groups(trainer["devices"] * trainer["num_nodes"], size, trainer["devices"])
    assert len(groups) == 4 and all(g[0] // 8 == g[-1] // 8 for g in groups)  # each group within one node
    assert size * data["batching"]["max_tokens"] >= data["corpus"]["max_doc_tokens"] == 524288
    callbacks = {c["class_path"].rsplit(".", 1)[-1] for c in trainer["callbacks"]}
    assert {"DynamicSparsityTuning", "BatchPlanMonitor", "DensityCalibration"} <= callbacks


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "mistral", "gemma3_text", "phi3"])
def test_dims_round_trip_through_hugging_face_config(family):
    dims = ModelConfig(preset="qwen2.5-0.5b").dims()
    assert ModelDims.from_hf_config(dims.to_hf_config(family)) == dims


@pytest.mark.parametrize(
    "model_type, why",
    [
        ("gemma2", "'gemma2' (Gemma2ForCausalLM) cannot be trained here: it soft-caps attention logits"),
        ("mamba", "'mamba' (MambaForCausalLM) cannot be trained here: its attention does not go through"),
        ("qwen3_next", "'qwen3_next' (Qwen3NextForCausalLM) cannot be trained here: its attention does not go"),
        ("cohere", "'cohere' (CohereForCausalLM) cannot be trained here: it transforms its logits after the head"),
    ],
)
def test_what_packed_sparse_training_cannot_represent_is_refused_in_one_line(model_type, why):
    with pytest.raises(ConfigError, match=f"^model {re.escape(why)}") as refused:
        ModelConfig(model_type=model_type, overrides={"num_layers": 2, "hidden_size": 64, "num_heads": 4,
                                                      "num_kv_heads": 2, "intermediate_size": 128})
    assert "\n" not in str(refused.value)


def test_a_pretrained_directory_is_checked_as_it_was_published(tmp_path):
    """A sliding window shorter than the context and soft-capped attention are what the plug-in would silently
    ignore; a directory is refused on either, a new model of the same family is not (its window spans its
    context)."""
    for name, settings, why in [
        ("mistral", {"sliding_window": 4096}, "sliding window of 4096 tokens is shorter than its context"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 1024, "max_window_layers": 0}, "sliding window"),
        ("gemma3_text", {}, "sliding window of 4096 tokens"),
    ]:
        config = AutoConfig.for_model(name, num_hidden_layers=2, **settings)
        config.save_pretrained(tmp_path / name)
        with pytest.raises(ConfigError, match=f"model '{name}' .*{why}"):
            ModelConfig(pretrained_path=str(tmp_path / name))
        check_architecture(ModelConfig(model_type=name).hf_config())  # a new model of the family attends fully


@pytest.mark.parametrize(
    "kwargs, setting",
    [
        ({"preset": "qwen9"}, "model.preset"),
        ({"pretrained_path": "/nonexistent"}, "model.pretrained_path"),
        ({"overrides": {"layers": 2}}, "model.overrides"),
        ({"overrides": {"num_heads": 3}}, "model.num_heads"),
        ({"model_type": "no_such_family"}, "model.model_type='no_such_family' is not a model family"),
    ],
)
def test_bad_model_settings_are_named(kwargs, setting):
    with pytest.raises(ConfigError, match=setting):
        ModelConfig(**kwargs).dims()
