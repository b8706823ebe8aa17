"""Packed micro-batches through our attention give what unmodified Hugging Face Qwen2 gives document by document."""

import pytest
import torch
from transformers import Qwen2ForCausalLM

from sparsebalance_pl.attention import AttentionConfig
from sparsebalance_pl.datamodules.packing import collate_packed
from sparsebalance_pl.model import ModelConfig
from sparsebalance_pl.module import SparseQwen

TINY = {"num_layers": 2, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256}


def _module(backend: str, tau: float = 0.9) -> SparseQwen:
    torch.manual_seed(0)
    module = SparseQwen(
        model=ModelConfig(preset="demo", overrides=TINY),
        attention=AttentionConfig(backend=backend, block_size=16, stride=4, tau=tau),
    )
    module.configure_model()
    return module


def _packed_batch(lengths: list[int], vocab: int, seed: int = 0) -> tuple[dict, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    return collate_packed([{"tokens": d.numpy()} for d in docs]), docs


def _packed_logits(module: SparseQwen, batch: dict) -> torch.Tensor:
    ctx = module.attention_context(batch["cu_seqlens"])
    hf = module.net.hf
    hidden = hf.model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, sb_context=ctx
    ).last_hidden_state
    return hf.lm_head(hidden)[0]


@pytest.mark.parametrize("reference_impl", ["eager", "sdpa"])
def test_dense_packed_matches_hugging_face_per_document(reference_impl):
    module = _module("dense")
    module.eval()
    reference = Qwen2ForCausalLM(module.net.hf.config.__class__(**{
        **module.net.hf.config.to_dict(), "attn_implementation": reference_impl}))
    reference.load_state_dict(module.net.hf.state_dict())
    reference.eval()
    lengths = [37, 100, 5, 64, 81]
    batch, docs = _packed_batch(lengths, module.dims.vocab_size)
    with torch.no_grad():
        packed = _packed_logits(module, batch)
        alone = torch.cat([reference(input_ids=d[None], use_cache=False).logits[0] for d in docs])
    assert packed.shape == alone.shape
    assert (packed - alone).abs().max().item() <= 1e-5


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
        assert set(module.last_context.masks) == {0, 1}
    assert ckpt.net.hf.model.gradient_checkpointing
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(plain.last_context.masks[1], ckpt.last_context.masks[1])
