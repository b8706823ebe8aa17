"""Block-sparse attention through PyTorch's FlexAttention: the layout's kept tiles as a ``BlockMask``.

The kept tiles that need no token mask (inside one document, below the diagonal) are FlexAttention's "full"
blocks, which it computes without calling the mask; the others are its partial blocks, masked token by token
by causality and document (``mask_mod``, which also holds the kept tiles for FlexAttention's uncompiled path).
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


def block_mask(layout: TileLayout) -> BlockMask:
    """The layout as a ``BlockMask`` over its stream (batch of one), kept in the layout's scratch."""
    if "flex" not in layout.scratch:
        partial = layout.partial()
        kinds = (layout.kept & partial, layout.kept & ~partial)
        lists = [tile_lists(tiles, transposed) for transposed in (False, True) for tiles in kinds]
        pad = layout.num_blocks * layout.block_size - layout.num_tokens
        doc = F.pad(layout.doc, (0, pad), value=-1)  # padding tokens share no document with real ones
        kept, block = layout.kept, layout.block_size

        def kept_causal_within_documents(batch, head, q_idx, kv_idx):
            # The kept-tile test matters where the mask is evaluated densely: uncompiled FlexAttention applies
            # only the mask, not the block lists.
            return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx]) & kept[head, q_idx // block, kv_idx // block]

        (kv_partial, kv_full, q_partial, q_full) = lists
        layout.scratch["flex"] = BlockMask(
            (layout.num_tokens, layout.num_tokens),
            kv_partial.count[None], kv_partial.index[None], kv_full.count[None], kv_full.index[None],
            q_partial.count[None], q_partial.index[None], q_full.count[None], q_full.index[None],
            BLOCK_SIZE=(layout.block_size, layout.block_size),
            mask_mod=kept_causal_within_documents,
        )
    return layout.scratch["flex"]


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
