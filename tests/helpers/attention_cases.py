"""Random packed streams with block masks, and the check of a backend against the dense fp64 reference, shared
by the attention backends' tests."""

import os

import torch

from sparsebalance_pl.kernels import block_sparse_attention, reference_block_sparse_attention
from sparsebalance_pl.kernels.layout import forced_tiles, token_doc_ids


#: Whether Triton kernels can run: on a GPU, or on the CPU under Triton's interpreter.
TRITON_OK = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def device_for(backend):
    return torch.device("cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")


def packed_case(seed, num_tokens, q_heads, kv_heads, head_dim, block_size, keep=0.5, always_kept=True, device="cpu"):
    """Random packed stream with documents not aligned to blocks and a random block mask, on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    num_docs = int(torch.randint(1, 5, (), generator=gen))
    cuts = torch.randperm(num_tokens - 1, generator=gen)[: num_docs - 1] + 1
    bounds = [0, *sorted(cuts.tolist()), num_tokens]
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    q = torch.randn(num_tokens, q_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    nb = -(-num_tokens // block_size)
    mask = torch.rand(q_heads, nb, nb, generator=gen) < keep
    if always_kept:
        mask |= forced_tiles(token_doc_ids(cu_seqlens, num_tokens), cu_seqlens, block_size)
    return tuple(x.to(device) for x in (q, k, v, mask, cu_seqlens))


def relative_error(x, ref):
    return float((x.detach().double() - ref.detach()).norm() / ref.detach().norm().clamp(min=1e-300))


def check_against_reference(backend, q, k, v, mask, cu, block_size, fwd_tol=1e-5, grad_tol=1e-4, seed=0):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = block_sparse_attention(q, k, v, mask, cu, block_size=block_size, backend=backend)
    ref = reference_block_sparse_attention(q, k, v, mask, cu, block_size=block_size)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert relative_error(out, ref) <= fwd_tol
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype).to(out.device)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad.double())
    for name, g, w in zip("qkv", got, want):
        assert torch.isfinite(g).all()
        assert relative_error(g, w) <= grad_tol, name
