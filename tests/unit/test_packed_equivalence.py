"""Packed micro-batches through our attention give what the unmodified Hugging Face model gives document by
document, in every family the module serves."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from sparsebalance_pl.attention import AttentionConfig
from sparsebalance_pl.datamodules.packing import collate_packed
from sparsebalance_pl.model import ModelConfig
from sparsebalance_pl.module import SparseCausalLM

TINY = {"num_layers": 2, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256}
#: The smallest dimensions that still exercise grouped KV heads, several blocks per document and documents that
#: start and end inside a block.
FAMILY_DIMS = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
               "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 512}
FAMILIES = ["qwen2", "qwen3", "llama", "mistral", "gemma3_text", "phi3"]


def _module(backend: str, tau: float = 0.9) -> SparseCausalLM:
    torch.manual_seed(0)
    module = SparseCausalLM(
        model=ModelConfig(preset="demo", overrides=TINY),
        attention=AttentionConfig(backend=backend, block_size=16, stride=4, tau=tau),
    )
    module.configure_model()
    return module


def _packed_batch(lengths: list[int], vocab: int, seed: int = 0) -> tuple[dict, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    return collate_packed([{"tokens": d.numpy()} for d in docs]), docs


def _packed_logits(module: SparseCausalLM, batch: dict) -> torch.Tensor:
    hf = module.net.hf
    hidden = hf.get_decoder()(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
        sparse_attention=module.begin_micro_batch(batch),
    ).last_hidden_state
    return hf.get_output_embeddings()(hidden)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_matches_the_unmodified_model_document_by_document(family):
    """Dense attention, and sparse attention at tau 1 (every causal block kept): the packed stream's logits and
    the gradients of its mean loss equal the unmodified model's run on each document alone."""
    lengths = [37, 100, 5, 64, 81]
    modules = {}
    for backend in ("dense", "sparse"):
        torch.manual_seed(0)
        modules[backend] = SparseCausalLM(model=ModelConfig(model_type=family, overrides=FAMILY_DIMS),
                                          attention=AttentionConfig(backend=backend, block_size=16, stride=4, tau=1.0))
        modules[backend].configure_model()
    reference = AutoModelForCausalLM.from_config(modules["dense"].model_config.hf_config(), attn_implementation="sdpa")
    reference.load_state_dict(modules["dense"].net.hf.state_dict())
    assert type(reference) is type(modules["dense"].net.hf) and type(reference).__name__.lower().startswith(
        family.split("_")[0])
    batch, docs = _packed_batch(lengths, FAMILY_DIMS["vocab_size"])
    targets = batch["targets"][0]
    count = int((targets != -100).sum())
    alone = torch.cat([reference(input_ids=d[None], use_cache=False).logits[0] for d in docs])
    torch.nn.functional.cross_entropy(alone, targets, ignore_index=-100, reduction="sum").div(count).backward()
    for backend, module in modules.items():
        packed = _packed_logits(module, batch)
        assert (packed - alone).abs().max().item() <= 1e-5, backend
        loss_sum, tokens = module(batch)
        assert int(tokens) == count
        (loss_sum / count).backward()
        for (name, ours), theirs in zip(module.net.hf.named_parameters(), reference.parameters()):
            assert (ours.grad - theirs.grad).abs().max().item() <= 1e-5, (backend, name)


def test_no_leakage_across_documents():
    module = _module("dense")
    batch, docs = _packed_batch([50, 60], module.dims.vocab_size)
    changed = dict(batch)
    changed["input_ids"] = batch["input_ids"].clone()
    changed["input_ids"][0, :50] = (changed["input_ids"][0, :50] + 1) % module.dims.vocab_size
    with torch.no_grad():
        a, b = _packed_logits(module, batch), _packed_logits(module, changed)
    assert torch.equal(a[50:], b[50:])
    assert not torch.equal(a[:50], b[:50])


def test_sparse_at_tau_one_equals_dense():
    dense, sparse = _module("dense"), _module("sparse", tau=1.0)
    sparse.net.load_state_dict(dense.net.state_dict())
    batch, _ = _packed_batch([150, 33, 200], dense.dims.vocab_size)
    with torch.no_grad():
        a, b = _packed_logits(dense, batch), _packed_logits(sparse, batch)
    assert (a - b).abs().max().item() <= 1e-5


def test_loss_gradients_match_plain_cross_entropy():
    module = _module("dense")
    batch, _ = _packed_batch([40, 70], module.dims.vocab_size)
    module.net.loss_chunk_tokens = 32  # several chunks
    loss_sum, count = module(batch)
    loss_sum.backward()
    fused = [p.grad.clone() for p in module.net.parameters()]
    module.net.zero_grad()
    logits = _packed_logits(module, batch)
    expected = torch.nn.functional.cross_entropy(logits, batch["targets"][0], ignore_index=-100, reduction="sum")
    expected.backward()
    assert count.item() == 40 + 70 - 2
    assert torch.allclose(loss_sum, expected, rtol=1e-5)
    for got, want in zip(fused, (p.grad for p in module.net.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_activation_checkpointing_reuses_masks_and_matches_gradients():
    plain = _module("sparse", tau=0.5)
    ckpt = _module("sparse", tau=0.5)
    ckpt.activation_checkpointing = True
    ckpt.net = None
    ckpt.configure_model()
    ckpt.net.load_state_dict(plain.net.state_dict())
    batch, _ = _packed_batch([150, 90], plain.dims.vocab_size)
    grads = []
    for module in (plain, ckpt):
        module.train()
        loss_sum, _ = module(batch)
        loss_sum.backward()
        grads.append([p.grad for p in module.net.parameters()])
        assert set(module.sparse_attention.micro_batch.masks) == {0, 1}
    assert ckpt.net.hf.model.gradient_checkpointing
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(plain.sparse_attention.micro_batch.masks[1], ckpt.sparse_attention.micro_batch.masks[1])
