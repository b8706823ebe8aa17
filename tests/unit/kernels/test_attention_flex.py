"""The FlexAttention backend against the dense fp64 reference: forward on the CPU (FlexAttention has no CPU
backward), forward and backward on a GPU where one exists."""

import pytest
import torch
from attention_cases import check_against_reference, packed_case, relative_error

from sparsebalance_pl.kernels import attention_flex, block_sparse_attention, reference_block_sparse_attention
from sparsebalance_pl.kernels import select_blocks
from sparsebalance_pl.kernels.attention_flex import FLEX_BLOCK
from sparsebalance_pl.kernels.layout import TileLayout

CUDA = torch.cuda.is_available()


def forward_matches_reference(q, k, v, mask, cu, block_size):
    out = block_sparse_attention(q, k, v, mask, cu, block_size=block_size, backend="flex")
    ref = reference_block_sparse_attention(q, k, v, mask, cu, block_size=block_size)
    assert out.shape == q.shape and out.dtype == q.dtype
    return relative_error(out, ref)


@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (4, 2), (7, 1)])
@pytest.mark.parametrize("num_tokens", [64, 150])  # whole blocks, and a padded tail
@pytest.mark.parametrize("seed", range(3))
def test_forward_matches_reference_with_gqa_documents_and_a_padded_tail(q_heads, kv_heads, num_tokens, seed):
    """Documents cut blocks at random places (packed_case), so tiles are full, partial or empty."""
    case = packed_case(seed, num_tokens, q_heads, kv_heads, 16, 16)
    assert forward_matches_reference(*case, block_size=16) <= 1e-5


def test_forward_matches_reference_on_masks_of_the_real_selection():
    q, k, v, _, cu = packed_case(4, 200, 4, 2, 32, 16)
    cu = torch.tensor([0, 37, 120, 200], dtype=torch.int32)
    for tau in (0.5, 0.9):
        mask = select_blocks(q, k, cu, block_size=16, tau=tau, stride=4, backend="torch")
        assert not mask.all()
        assert forward_matches_reference(q, k, v, mask, cu, block_size=16) <= 1e-5


@pytest.mark.parametrize("block_size", [32, 64, 256])
def test_flex_blocks_of_several_tiles_are_full_only_when_all_their_tiles_are(block_size):
    """FlexAttention's blocks are at least FLEX_BLOCK tokens: smaller tiles are grouped, a group is a full block only
    where every tile in it is kept and needs no token mask, and a partial block masks the tiles it does not keep."""
    num_tokens = 4 * max(block_size, FLEX_BLOCK) + 40  # a padded tail
    q, k, v, mask, _ = packed_case(6, num_tokens, 4, 2, 16, block_size, keep=0.8)
    cu = torch.tensor([0, 70, num_tokens], dtype=torch.int32)  # a long document: blocks below the diagonal are full
    all_kept = torch.ones_like(mask)
    for kept in (mask, all_kept):
        flex = attention_flex.block_mask(TileLayout.build(kept, cu, num_tokens, 2, block_size))
        assert flex.BLOCK_SIZE == (max(block_size, FLEX_BLOCK),) * 2
        assert flex.kv_num_blocks.sum() > 0  # partial blocks
        assert forward_matches_reference(q, k, v, kept, cu, block_size=block_size) <= 1e-5
    assert flex.full_kv_num_blocks.sum() > 0  # with every tile kept, the blocks below the diagonal are full


def test_rows_without_allowed_keys_give_zero():
    q, k, v, mask, cu = packed_case(5, 64, 2, 1, 16, 16, keep=0.3, always_kept=False)
    mask[0, 2, :] = False
    out = block_sparse_attention(q, k, v, mask, cu, block_size=16, backend="flex")
    assert torch.all(out[32:48, 0] == 0) and torch.isfinite(out).all()
    assert forward_matches_reference(q, k, v, mask, cu, block_size=16) <= 1e-5


@pytest.mark.skipif(CUDA, reason="on the CPU only")
def test_training_on_the_cpu_is_refused_in_one_line():
    q, k, v, mask, cu = packed_case(0, 64, 2, 2, 16, 16)
    q.requires_grad_()
    with pytest.raises(ValueError, match="no backward on the CPU.*backend='torch'"):
        block_sparse_attention(q, k, v, mask, cu, block_size=16, backend="flex")
    with torch.no_grad():  # evaluation needs no backward
        block_sparse_attention(q, k, v, mask, cu, block_size=16, backend="flex")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: FlexAttention's backward does not run on the CPU")
@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (7, 1)])
@pytest.mark.parametrize("seed", range(2))
def test_forward_and_backward_match_reference_on_cuda(q_heads, kv_heads, seed):
    case = packed_case(seed, 300, q_heads, kv_heads, 64, 64, device="cuda")
    check_against_reference("flex", *case, block_size=64, grad_tol=1e-3, seed=seed)
