"""A local Hugging Face directory of any supported family supplies the weights and the tokenizer; nothing is
downloaded, and no weight is dropped."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from sparsebalance_pl.attention import ATTN_IMPLEMENTATION
from sparsebalance_pl.datamodules.tokenizer import load_tokenizer
from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.model import ModelConfig, build_model


def _save_local_model(path, family: str = "qwen2"):
    torch.manual_seed(0)
    config = ModelConfig(model_type=family, overrides={"num_layers": 2, "hidden_size": 64, "num_heads": 4,
                                                       "intermediate_size": 128}).hf_config()
    model = build_model(config, "sdpa")
    model.save_pretrained(path)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(["the pass key is 12345", "the value of key ab12 is"] * 10,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<|endoftext|>"]))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(path)
    return model


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_weights_and_tokenizer_come_from_the_local_directory(tmp_path, family):
    saved = _save_local_model(tmp_path, family)
    config = ModelConfig(pretrained_path=str(tmp_path))
    loaded = config.build(ATTN_IMPLEMENTATION)
    assert config.dims().num_layers == 2 and type(loaded) is type(saved)
    assert loaded.config.model_type == family
    with pytest.raises(RuntimeError, match="needs the model to be called with sparse_attention="):
        loaded(input_ids=torch.zeros(1, 4, dtype=torch.long))  # it attends through our plug-in
    assert saved.state_dict().keys() == loaded.state_dict().keys()  # Qwen3's q/k norms too
    for (name, a), (_, b) in zip(saved.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    tokenizer = load_tokenizer(str(tmp_path))
    ids = tokenizer.encode("the pass key")
    assert ids and tokenizer.decode(ids).replace(" ", "") == "thepasskey"
    assert tokenizer.eos_id == 1
    # The directory's own tokenizer, not the one its model type implies (transformers maps model_type qwen2 to
    # Qwen's pre-tokenizer, which a converted SmolLM2 does not use).
    own = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "the value of key ab12 is 12345"
    assert tokenizer.encode(text) == own.encode(text, add_special_tokens=False).ids


def test_a_pretrained_context_is_extended_by_overrides_and_nothing_else(tmp_path):
    saved = _save_local_model(tmp_path)
    config = ModelConfig(pretrained_path=str(tmp_path),
                         overrides={"rope_theta": 1.0e7, "max_position_embeddings": 524288})
    loaded = config.build(ATTN_IMPLEMENTATION)
    assert loaded.config.rope_parameters["rope_theta"] == 1.0e7 and loaded.config.max_position_embeddings == 524288
    assert config.dims().rope_theta == 1.0e7 and config.dims().max_position_embeddings == 524288
    slower = loaded.model.rotary_emb.inv_freq / saved.model.rotary_emb.inv_freq  # the rotary frequencies follow
    assert slower[0] == 1.0 and slower[-1] < 0.5
    for (name, a), (_, b) in zip(saved.state_dict().items(), loaded.state_dict().items()):
        if "rotary" not in name:
            assert torch.equal(a, b), name
    with pytest.raises(ConfigError, match=r"model.overrides \['num_layers'\] would change the shapes"):
        ModelConfig(pretrained_path=str(tmp_path), overrides={"num_layers": 1})
