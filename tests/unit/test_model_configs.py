"""The shipped configurations describe the published architectures, built on the meta device."""


import pytest
import torch
import yaml
from transformers import Qwen2ForCausalLM
from main_runner import REPO

from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.model import ModelConfig, ModelDims

CONFIGS = REPO / "configs"


def _meta_model(config_file: str) -> tuple[ModelConfig, Qwen2ForCausalLM]:
    cfg = yaml.safe_load((CONFIGS / config_file).read_text())
    model_config = ModelConfig(**cfg["model"]["model"])
    with torch.device("meta"):
        return model_config, Qwen2ForCausalLM(model_config.dims().to_hf_config("sdpa"))


@pytest.mark.parametrize(
    "config_file, parameters",
    [("qwen05b.yaml", 494_032_768), ("qwen3b.yaml", 3_085_938_688)],
)
def test_published_parameter_counts(config_file, parameters):
    _, model = _meta_model(config_file)
    assert sum(p.numel() for p in model.parameters()) == parameters  # tied embeddings counted once
    assert all(p.device.type == "meta" for p in model.parameters())


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


def test_dims_round_trip_through_hugging_face_config():
    dims = ModelConfig(preset="qwen2.5-0.5b").dims()
    assert ModelDims.from_hf_config(dims.to_hf_config()) == dims


@pytest.mark.parametrize(
    "kwargs, setting",
    [
        ({"preset": "qwen9"}, "model.preset"),
        ({"pretrained_path": "/nonexistent"}, "model.pretrained_path"),
        ({"overrides": {"layers": 2}}, "model.overrides"),
        ({"overrides": {"num_heads": 3}}, "model.num_heads"),
    ],
)
def test_bad_model_settings_are_named(kwargs, setting):
    with pytest.raises(ConfigError, match=setting):
        ModelConfig(**kwargs).dims()
