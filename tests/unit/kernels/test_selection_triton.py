"""The Triton selection scoring (compiled on CUDA, else under TRITON_INTERPRET=1) against the torch scoring."""

import os

import pytest
import torch

from sparsebalance_pl.kernels import select_blocks
from sparsebalance_pl.kernels.layout import token_doc_ids
from sparsebalance_pl.kernels.selection import estimate_block_mass

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs CUDA or TRITON_INTERPRET=1",
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "q_heads,kv_heads,block_size,stride,num_tokens",
    [(2, 2, 16, 4, 101), (4, 2, 16, 8, 101), (7, 1, 32, 16, 101), (2, 1, 16, 4, 700)],  # 700: several programs
)
def test_triton_scoring_matches_torch(q_heads, kv_heads, block_size, stride, num_tokens):
    from sparsebalance_pl.kernels.selection_triton import estimate_block_mass as estimate_triton

    gen = torch.Generator().manual_seed(q_heads)
    q = torch.randn(num_tokens, q_heads, 16, generator=gen)
    k = torch.randn(num_tokens, kv_heads, 16, generator=gen)
    cu = torch.tensor([0, 30, 33, num_tokens], dtype=torch.int32)
    q, k, cu = q.to(DEVICE), k.to(DEVICE), cu.to(DEVICE)
    doc = token_doc_ids(cu, num_tokens)
    want = estimate_block_mass(q, k, doc, block_size, stride, 0.25)
    got = estimate_triton(q, k, doc, block_size, stride, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_select_blocks_triton_backend_matches_torch():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(80, 4, 16, generator=gen), torch.randn(80, 2, 16, generator=gen)
    cu = torch.tensor([0, 50, 80], dtype=torch.int32)
    q, k, cu = q.to(DEVICE), k.to(DEVICE), cu.to(DEVICE)
    kwargs = dict(block_size=16, tau=0.8, stride=4)
    triton_mask = select_blocks(q, k, cu, backend="triton", **kwargs)
    assert torch.equal(triton_mask, select_blocks(q, k, cu, backend="torch", **kwargs))


def test_half_precision_scoring_matches_torch():
    """bf16 inputs (tensor-core products on CUDA) give the fp32 scoring of the same values."""
    from sparsebalance_pl.kernels.selection_triton import estimate_block_mass as estimate_triton

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(300, 4, 64, generator=gen).to(DEVICE, torch.bfloat16)
    k = torch.randn(300, 2, 64, generator=gen).to(DEVICE, torch.bfloat16)
    doc = token_doc_ids(torch.tensor([0, 120, 300], dtype=torch.int32, device=DEVICE), 300)
    want = estimate_block_mass(q, k, doc, 32, 8, 0.125)
    got = estimate_triton(q, k, doc, 32, 8, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
