"""Context-parallel pieces in one process: the block-striped shard and its inverse, the ring-step tile
layouts, and sparse_ring_attention as a ring of one (no process group). The multi-rank ring is
tests/multiprocess/test_ring_attention.py."""

import pytest
import torch
from attention_cases import TRITON_OK

from sparsebalance_pl.kernels import (
    PackedDocuments,
    block_sparse_attention,
    context_shard,
    context_unshard,
    sparse_ring_attention,
)
from sparsebalance_pl.kernels.layout import TileLayout, forced_tiles, token_doc_ids

BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")),
]


def test_shard_is_block_striped_and_unshard_inverts_it():
    x = torch.arange(96).repeat_interleave(3).view(96, 3)  # extra dims travel with the tokens
    shards = [context_shard(x, world_size=3, rank=r, block_size=8) for r in range(3)]
    assert shards[1][:, 0].tolist() == [*range(8, 16), *range(32, 40), *range(56, 64), *range(80, 88)]
    assert torch.equal(context_unshard(shards, block_size=8), x)
    assert torch.equal(context_shard(x, world_size=1, rank=0, block_size=8), x)


def test_shard_and_unshard_reject_bad_arguments():
    x = torch.zeros(100, 2)
    with pytest.raises(ValueError, match="multiple of world_size \\* block_size = 64"):
        context_shard(x, world_size=4, rank=0, block_size=16)
    with pytest.raises(ValueError, match="rank"):
        context_shard(torch.zeros(64), world_size=4, rank=4, block_size=16)
    with pytest.raises(ValueError, match="world_size"):
        context_shard(torch.zeros(64), world_size=0, rank=0, block_size=16)
    with pytest.raises(ValueError, match="shards"):
        context_unshard([torch.zeros(16), torch.zeros(32)], block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        context_unshard([torch.zeros(24), torch.zeros(24)], block_size=16)


def _stream(seed, num_tokens, dtype=torch.float64, keep=0.5):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 5, 33, num_tokens - 20, num_tokens], dtype=torch.int32)
    q = torch.randn(num_tokens, 4, 16, generator=gen, dtype=dtype)
    k, v = (torch.randn(num_tokens, 2, 16, generator=gen, dtype=dtype) for _ in range(2))
    nb = num_tokens // 16
    mask = (torch.rand(4, nb, nb, generator=gen) < keep) | forced_tiles(token_doc_ids(cu, num_tokens), cu, 16)
    return q, k, v, cu, mask


def _global_tiles(layout, q_blocks, k_blocks):
    """{(head, global query block, global key block): partial} of a ring-step layout."""
    tiles = layout.rows()
    local_rows = tiles.tile_row % layout.num_blocks - (layout.num_blocks - q_blocks.numel())
    heads = (tiles.tile_row // layout.num_blocks).tolist()
    rows, cols = q_blocks[local_rows].tolist(), k_blocks[tiles.tile_col].tolist()
    return {(h, r, c): p for h, r, c, p in zip(heads, rows, cols, tiles.tile_partial.tolist())}


@pytest.mark.parametrize("with_mask", [True, False])
def test_ring_step_layouts_cover_the_whole_stream_layout(with_mask):
    """Over all ranks and steps the tiles (in global coordinates, with their token-mask flags) are those of
    the one-process layout, each once."""
    world_size, num_tokens = 4, 256
    _, _, _, cu, mask = _stream(1, num_tokens, keep=0.3)
    mask = mask if with_mask else torch.ones_like(mask)
    doc = token_doc_ids(cu, num_tokens)
    whole = TileLayout.build(mask, cu, num_tokens, 2, 16)
    want = _global_tiles(whole, torch.arange(16), torch.arange(16))
    got = {}
    for rank in range(world_size):
        for source in range(world_size):
            step = TileLayout.build_ring_step(mask if with_mask else None, doc, 4, 2, 16,
                                              world_size=world_size, rank=rank, source=source)
            assert step.num_tokens == num_tokens // world_size * (1 if source == rank else 2)
            tiles = _global_tiles(step, torch.arange(rank, 16, 4), torch.arange(source, 16, 4))
            # Kept from a ring's forward until its backward, a released layout holds its queries' tiles against
            # its keys, not the stream's [Hq, nB, nB], which it derives again
            step.release()
            assert not step.scratch
            assert step.tiles.shape == (4, 4, 4) and step.tiles.untyped_storage().nbytes() <= 4 * 4 * 4
            assert torch.equal(step.kept[:, -4:, :4], step.tiles) and step.kept.sum() == step.tiles.sum()
            assert not set(tiles) & set(got)
            got.update(tiles)
    assert got == want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_mask", [True, False])
def test_ring_of_one_equals_block_sparse_attention(backend, with_mask):
    """Without a process group the ring has one rank and one step: exactly block_sparse_attention."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    device = torch.device("cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")
    q, k, v, cu, mask = (x.to(device) for x in _stream(2, 64 if backend == "triton" else 128, dtype))
    mask[1, 2] = False  # a query block that sees nothing
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = sparse_ring_attention(q, k, v, cu, block_size=16, block_mask=mask if with_mask else None, backend=backend)
    want = block_sparse_attention(q, k, v, mask if with_mask else torch.ones_like(mask), cu, block_size=16,
                                  backend=backend)
    shared = sparse_ring_attention(q, k, v, PackedDocuments(cu, q.shape[0], 16), block_size=16,
                                   block_mask=mask if with_mask else None, backend=backend)
    grad = torch.randn_like(out)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(shared, out, rtol=0, atol=0)  # the layers' shared documents in place of the bounds
    for got, expected in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(got, expected, rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=1e-12)


def test_ring_rejects_bad_arguments():
    q, k, v, cu, mask = _stream(3, 128)
    with pytest.raises(ValueError, match="not a multiple of block_size 16"):
        sparse_ring_attention(q[:120], k[:120], v[:120], cu, block_size=16)
    with pytest.raises(ValueError, match="block_mask"):
        sparse_ring_attention(q, k, v, cu, block_size=16, block_mask=mask[:, :-1])
    with pytest.raises(ValueError, match="cu_seqlens"):
        sparse_ring_attention(q, k, v, cu[:-1], block_size=16)
    with pytest.raises(ValueError, match="power of two"):
        sparse_ring_attention(q, k, v, cu, block_size=24)
    with pytest.raises(ValueError, match="auto, torch, triton"):
        sparse_ring_attention(q, k, v, cu, block_size=16, backend="flash")
    with pytest.raises(ValueError, match="node_size"):
        sparse_ring_attention(q, k, v, cu, block_size=16, node_size=2)  # a ring of one has no node of two
