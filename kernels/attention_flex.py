"""Block-sparse attention through PyTorch's FlexAttention: the layout's kept tiles as a ``BlockMask``.

FlexAttention's blocks are at least ``FLEX_BLOCK`` tokens: its compiled kernels take tiles of up to 128 rows,
which must divide a block (its only backward configuration for head dim 64 to 128 on Hopper is 128 wide). A block
made of kept tiles that all need no token mask (inside one document, below the diagonal) is one of FlexAttention's
"full" blocks, which it computes without calling the mask; a block holding any other kept tile is a partial one,
masked token by token by causality, document and the kept tiles (``mask_mod``).
Key and value heads are shared by query groups (``enable_gqa``), never repeated. Every list is built with
fixed-shape ops, so nothing is read back from the device.

On CUDA the attention runs compiled, once for all stream lengths (dynamic shapes); on the CPU it runs eagerly,
forward only: FlexAttention has no backward on the CPU.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .layout import TileLayout, tile_lists


# The least block FlexAttention's compiled kernels can all tile (its own default).
FLEX_BLOCK = 128


def block_mask(layout: TileLayout) -> BlockMask:
    """The layout as a ``BlockMask`` over its stream (batch of one), kept in the layout's scratch."""
    if "flex" not in layout.scratch:
        kept, block = layout.kept, layout.block_size
        full, kept_any = _coarse(kept & ~layout.partial(), block, "all"), _coarse(kept, block, "any")
        kinds = (kept_any & ~full, full)
        lists = [tile_lists(tiles, transposed) for transposed in (False, True) for tiles in kinds]
        pad = layout.num_blocks * block - layout.num_tokens
        doc = F.pad(layout.doc, (0, pad), value=-1)  # padding tokens share no document with real ones

        def kept_causal_within_documents(batch, head, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx]) & kept[head, q_idx // block, kv_idx // block]

        (kv_partial, kv_full, q_partial, q_full) = lists
        layout.scratch["flex"] = BlockMask(
            (layout.num_tokens, layout.num_tokens),
            kv_partial.count[None], kv_partial.index[None], kv_full.count[None], kv_full.index[None],
            q_partial.count[None], q_partial.index[None], q_full.count[None], q_full.index[None],
            BLOCK_SIZE=(max(block, FLEX_BLOCK),) * 2,
            mask_mod=kept_causal_within_documents,
        )
    return layout.scratch["flex"]


def _coarse(tiles: torch.Tensor, block_size: int, reduce: str) -> torch.Tensor:
    """bool [H, nB, nB] tiles of ``block_size`` tokens as tiles of ``max(block_size, FLEX_BLOCK)``: whether ``any``
    or ``all`` of the tiles each one covers are set (tiles past the stream's end count as unset)."""
    factor = max(1, FLEX_BLOCK // block_size)
    if factor == 1:
        return tiles
    heads, nb, _ = tiles.shape
    pad = -nb % factor
    tiles = F.pad(tiles, (0, pad, 0, pad)).view(heads, (nb + pad) // factor, factor, (nb + pad) // factor, factor)
    return tiles.any(dim=4).any(dim=2) if reduce == "any" else tiles.all(dim=4).all(dim=2)


@functools.cache
def _compiled():
    return torch.compile(flex_attention, dynamic=True)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TileLayout, scale: float) -> torch.Tensor:
    """[T, Hq, D] attention of the layout's kept tiles, differentiable on CUDA (forward only on the CPU)."""
    if q.device.type == "cpu":
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            raise ValueError("the flex backend has no backward on the CPU (FlexAttention's limit): use backend='torch'")
        q, k, v = q.detach(), k.detach(), v.detach()  # FlexAttention refuses CPU inputs that require grad
    run = _compiled() if q.is_cuda else flex_attention
    out = run(*(x.transpose(0, 1)[None] for x in (q, k, v)), block_mask=block_mask(layout), scale=scale,
              enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)
