"""The Triton selection scoring (compiled on CUDA, else under TRITON_INTERPRET=1) against the torch scoring."""

import os

import pytest
import torch

from sparsebalance_pl.kernels import LayerBudget, select_blocks, select_with_budget
from sparsebalance_pl.kernels.layout import token_doc_ids
from sparsebalance_pl.kernels.selection import estimate_block_mass

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs CUDA or TRITON_INTERPRET=1",
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "q_heads,kv_heads,block_size,stride,num_tokens,head_dim",
    # 700: several programs; head dim 128: 32-row fp32 tiles
    [(2, 2, 16, 4, 101, 16), (4, 2, 16, 8, 101, 16), (7, 1, 32, 16, 101, 16), (2, 1, 16, 4, 700, 16),
     (2, 1, 16, 4, 300, 128)],
)
def test_triton_scoring_matches_torch(q_heads, kv_heads, block_size, stride, num_tokens, head_dim):
    from sparsebalance_pl.kernels.selection_triton import estimate_block_mass as estimate_triton

    gen = torch.Generator().manual_seed(q_heads)
    q = torch.randn(num_tokens, q_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
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


@pytest.mark.parametrize("head_dim", [64, 256])  # 256: 32-row tiles
def test_half_precision_scoring_matches_torch(head_dim):
    """bf16 inputs (tensor-core products on CUDA) give the fp32 scoring of the same values."""
    from sparsebalance_pl.kernels.selection_triton import estimate_block_mass as estimate_triton

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(300, 4, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    k = torch.randn(300, 2, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    doc = token_doc_ids(torch.tensor([0, 120, 300], dtype=torch.int32, device=DEVICE), 300)
    want = estimate_block_mass(q, k, doc, 32, 8, 0.125)
    got = estimate_triton(q, k, doc, 32, 8, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("budget", [LayerBudget(0.8), LayerBudget(0.8, 0.5), LayerBudget(0.95, 0.4, 0.6),
                                    LayerBudget(1.0, None, 1.5)], ids=["tau", "cap", "scaled", "raised"])
def test_budgets_applied_by_the_ranking_kernel_match_torch(budget):
    """The Triton ranking applies the budget in use and the base budget in its launch (counts, kept masses and
    the mask): the same as the torch ranking's budgets on the same block masses."""
    from sparsebalance_pl.kernels import selection_triton

    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(300, 4, 16, generator=gen), torch.randn(300, 2, 16, generator=gen)
    cu = torch.tensor([0, 70, 71, 230, 300], dtype=torch.int32)
    q, k, cu = q.to(DEVICE), k.to(DEVICE), cu.to(DEVICE)
    base = LayerBudget(0.9, 0.7)
    got = select_with_budget(q, k, cu, budget, base, block_size=16, stride=4, backend="triton")
    # the torch path scores, ranks and applies the budgets in torch; the masses differ by rounding only
    want = select_with_budget(q, k, cu, budget, base, block_size=16, stride=4, backend="torch")
    doc = token_doc_ids(cu, 300)
    mass = selection_triton.estimate_block_mass(q, k, doc, 16, 4, 0.25)
    torch.testing.assert_close(mass, estimate_block_mass(q, k, doc, 16, 4, 0.25), rtol=1e-4, atol=1e-6)
    assert got.stats.ranking.known  # the kernel applied the budgets
    assert torch.equal(got.mask, want.mask)
    for mine, theirs in ((got.stats, want.stats), (got.base_stats, want.base_stats)):
        assert torch.equal(mine.kept, theirs.kept)
        torch.testing.assert_close(mine.kept_mass, theirs.kept_mass, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.base_document_density, want.base_document_density)
