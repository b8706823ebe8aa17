"""Block-sparse attention in plain torch (the CPU backend): forward and hand-written backward.

Work is proportional to the kept tiles. Rows (query head, query block) are sorted by their number of kept
key blocks and cut into chunks; in a chunk every row gathers its kept K/V blocks side by side (padded to
the chunk's longest row with a dummy block that masks itself out), so each row is one [B, D] x [D, n*B]
matmul and one ordinary softmax, with no scatter across tiles and no T x T matrix. Only tiles that need it
(diagonal, document boundaries, padding) get a token-level mask. Chunks are small enough for their scores
to stay in cache. The backward recomputes probabilities from the saved log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import TileLayout

# Score elements (rows x B x kept keys) per chunk: small enough for the elementwise softmax passes to run
# in cache, large enough to amortise the per-chunk operator overhead.
_CHUNK_ELEMENTS = 1 << 19


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _to_blocks(x: torch.Tensor, layout: TileLayout, dtype: torch.dtype, extra_block: bool = False) -> torch.Tensor:
    """[T, H, D] -> contiguous [H, nB (+1), B, D] in ``dtype``, zero-padded to whole blocks (plus an optional
    all-zero dummy block per head, the target of padded slots)."""
    num_tokens, heads, head_dim = x.shape
    blocks = layout.num_blocks + int(extra_block)
    x = x.to(dtype)
    padding = blocks * layout.block_size - num_tokens
    x = torch.cat([x, x.new_zeros(padding, heads, head_dim)]) if padding else x
    return x.reshape(blocks, layout.block_size, heads, head_dim).permute(2, 0, 1, 3).contiguous()


def _from_blocks(x: torch.Tensor, layout: TileLayout, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``_to_blocks``: [H, nB (+1), B, D] -> [T, H, D]."""
    heads, _, _, head_dim = x.shape
    x = x[:, : layout.num_blocks].reshape(heads, layout.num_blocks * layout.block_size, head_dim)
    return x[:, : layout.num_tokens].transpose(0, 1).to(dtype).contiguous()


@dataclass
class _Chunk:
    rows: torch.Tensor  # [R] global rows h * nB + qb
    kv_slots: torch.Tensor  # [R, n] indices into the flattened [Hkv * (nB + 1)] K/V blocks
    mask_row: torch.Tensor  # [M] local row of each tile needing a token mask
    mask_slot: torch.Tensor  # [M] its slot
    blocked: torch.Tensor  # [M, B, B] True where the pair is not allowed


def _plan(layout: TileLayout) -> list[_Chunk]:
    """Chunks of rows with similar kept counts, each padded to its longest row (built once per layout,
    shared by forward and backward)."""
    if "torch_plan" not in layout.scratch:
        layout.scratch["torch_plan"] = _build_plan(layout)
    return layout.scratch["torch_plan"]


def _build_plan(layout: TileLayout) -> list[_Chunk]:
    block, nb = layout.block_size, layout.num_blocks
    counts = layout.row_ptr[1:] - layout.row_ptr[:-1]
    order = torch.argsort(counts, descending=True, stable=True)
    sorted_counts = counts[order].tolist()
    pad = (nb + 1) * block - layout.num_tokens
    doc_q = torch.cat([layout.doc, layout.doc.new_full((pad,), -1)])
    doc_k = torch.cat([layout.doc, layout.doc.new_full((pad,), -2)])  # padding and dummy never match
    offs = torch.arange(block, device=counts.device)
    chunks, start = [], 0
    while start < len(sorted_counts) and sorted_counts[start] > 0:
        width = sorted_counts[start]
        stop = min(start + max(1, _CHUNK_ELEMENTS // (width * block * block)), len(sorted_counts))
        rows = order[start:stop]
        slot = torch.arange(width, device=counts.device)
        valid = slot[None, :] < counts[rows, None]
        tile = torch.where(valid, layout.row_ptr[rows, None] + slot, 0)
        kb = torch.where(valid, layout.tile_col[tile], nb)
        kv_head = (rows // nb) // layout.group_size
        mask_row, mask_slot = torch.where(~valid | layout.tile_partial[tile])
        qpos = (rows[mask_row] % nb)[:, None] * block + offs
        kpos = kb[mask_row, mask_slot][:, None] * block + offs
        allowed = (doc_q[qpos][:, :, None] == doc_k[kpos][:, None, :]) & (kpos[:, None, :] <= qpos[:, :, None])
        chunks.append(_Chunk(rows, kv_head[:, None] * (nb + 1) + kb, mask_row, mask_slot, ~allowed))
        start = stop
    return chunks


def _scores(chunk: _Chunk, q_rows: torch.Tensor, k_cols: torch.Tensor, block: int) -> torch.Tensor:
    """[R, B, n * B] scores of each row against its gathered key blocks, disallowed pairs at -inf."""
    s = torch.bmm(q_rows, k_cols.transpose(1, 2))
    if chunk.mask_row.numel():
        tiles = s.view(s.shape[0], block, -1, block)
        picked = tiles[chunk.mask_row, :, chunk.mask_slot, :]
        tiles[chunk.mask_row, :, chunk.mask_slot, :] = picked.masked_fill_(chunk.blocked, float("-inf"))
    return s


def _gather(blocks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[H * (nB + 1), B, D] blocks at slots [R, n] -> [R, n * B, D] (index_select: a plain block copy,
    several times faster than advanced indexing here)."""
    return blocks.index_select(0, slots.flatten()).view(slots.shape[0], -1, blocks.shape[-1])


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TileLayout, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the output [T, Hq, D] in q's dtype and the log-sum-exp [Hq * nB, B] (fp32 or fp64; -inf on
    rows with nothing allowed, whose output is 0)."""
    dtype, block = _compute_dtype(q.dtype), layout.block_size
    q_blocks = (_to_blocks(q, layout, dtype) * scale).flatten(0, 1)
    k_blocks, v_blocks = (_to_blocks(x, layout, dtype, extra_block=True).flatten(0, 1) for x in (k, v))
    out = torch.zeros_like(q_blocks)
    lse = torch.full(q_blocks.shape[:2], float("-inf"), dtype=dtype, device=q.device)
    for chunk in _plan(layout):
        s = _scores(chunk, q_blocks[chunk.rows], _gather(k_blocks, chunk.kv_slots), block)
        # One fused softmax pass plus two max passes: the largest probability is 1 / sum(exp(s - max)), so
        # lse = max - log(max p) without a separate (and slower) logsumexp.
        row_max = s.amax(dim=-1)
        p = torch.softmax(s, dim=-1)
        empty = torch.isinf(row_max).nonzero(as_tuple=True)
        if empty[0].numel():
            p[empty] = 0.0
        out[chunk.rows] = torch.bmm(p, _gather(v_blocks, chunk.kv_slots))
        lse[chunk.rows] = torch.where(torch.isinf(row_max), row_max, row_max - p.amax(dim=-1).log())
    return _from_blocks(out.view(-1, layout.num_blocks, block, q.shape[-1]), layout, q.dtype), lse


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    layout: TileLayout,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v from the saved output and log-sum-exp, visiting the kept tiles only."""
    dtype, block = _compute_dtype(q.dtype), layout.block_size
    q_blocks = (_to_blocks(q, layout, dtype) * scale).flatten(0, 1)
    do_blocks = _to_blocks(grad_out, layout, dtype).flatten(0, 1)
    k_blocks, v_blocks = (_to_blocks(x, layout, dtype, extra_block=True).flatten(0, 1) for x in (k, v))
    delta = (_to_blocks(out, layout, dtype).flatten(0, 1) * do_blocks).sum(dim=-1)  # [Hq * nB, B]
    # Rows with nothing allowed have lse = -inf; +inf makes their probabilities exactly 0.
    lse = torch.where(torch.isinf(lse), float("inf"), lse)
    dq = torch.zeros_like(q_blocks)
    dk, dv = torch.zeros_like(k_blocks), torch.zeros_like(v_blocks)
    for chunk in _plan(layout):
        q_rows, do_rows = q_blocks[chunk.rows], do_blocks[chunk.rows]
        k_cols, v_cols = _gather(k_blocks, chunk.kv_slots), _gather(v_blocks, chunk.kv_slots)
        p = _scores(chunk, q_rows, k_cols, block).sub_(lse[chunk.rows].unsqueeze(-1)).exp_()
        slots = chunk.kv_slots.flatten()
        dv.index_add_(0, slots, torch.bmm(p.transpose(1, 2), do_rows).view(-1, block, q.shape[-1]))
        ds = torch.bmm(do_rows, v_cols.transpose(1, 2)).sub_(delta[chunk.rows].unsqueeze(-1)).mul_(p)
        dq[chunk.rows] = torch.bmm(ds, k_cols)
        dk.index_add_(0, slots, torch.bmm(ds.transpose(1, 2), q_rows).view(-1, block, q.shape[-1]))
    shape = (-1, layout.num_blocks + 1, block, q.shape[-1])
    return (
        _from_blocks((dq * scale).view(-1, layout.num_blocks, block, q.shape[-1]), layout, q.dtype),
        _from_blocks(dk.view(shape), layout, k.dtype),
        _from_blocks(dv.view(shape), layout, v.dtype),
    )
