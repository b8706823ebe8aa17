"""Triton version of the selection scoring: stride antidiagonal scores, softmax and block sums fused.

Same result as ``selection.estimate_block_mass`` without materialising the (T/S)^2 stride-level scores:
one program per run of query blocks and query head makes two passes over the causal key groups, the first for the
softmax max and normaliser of each stride row, the second to add the probabilities up per key block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launches import launch
from .layout import group_doc_range, num_blocks

_LOG2E = 1.4426950408889634


@triton.jit
def _stride_scores(Q, K, rows, cols, head, kv_head, row_ok, col_ok, first_q, last_k, qk_scale, T,
                   stride_qt, stride_qh, stride_kt, stride_kh,
                   STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_D: tl.constexpr, NATIVE: tl.constexpr):
    """Base-2 scaled antidiagonal sums of stride tiles (rows x cols); causal, document-sharing cells only.

    NATIVE multiplies half-precision inputs on the tensor cores (fp32 accumulation); otherwise the
    products are fp32 without TF32, which is also the path the interpreter takes.
    """
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for i in range(STRIDE):
        q_tok = rows * STRIDE + i
        k_tok = cols * STRIDE + (STRIDE - 1 - i)
        q = tl.load(Q + q_tok[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=(row_ok & (q_tok < T))[:, None] & d_ok[None, :], other=0.0)
        k = tl.load(K + k_tok[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=(col_ok & (k_tok < T))[:, None] & d_ok[None, :], other=0.0)
        if NATIVE:
            acc += tl.dot(q, tl.trans(k))
        else:
            acc += tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    allowed = (cols[None, :] <= rows[:, None]) & (first_q[:, None] <= last_k[None, :]) & col_ok[None, :]
    return tl.where(allowed, acc * qk_scale, float("-inf"))


@triton.jit
def _block_mass_kernel(
    Q, K, FIRST, LAST, MASS,
    qk_scale, T, NUM_GROUPS, NB,
    stride_qt, stride_qh, stride_kt, stride_kh,
    GROUP: tl.constexpr, STRIDE: tl.constexpr, PER_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, NATIVE: tl.constexpr,
):
    """One program per (BLOCK_R stride rows, query head): BLOCK_R / PER_BLOCK whole query blocks."""
    QBS: tl.constexpr = BLOCK_R // PER_BLOCK
    KBS: tl.constexpr = BLOCK_C // PER_BLOCK
    pid = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < NUM_GROUPS
    first_q = tl.load(FIRST + rows, mask=row_ok, other=0)
    end_col = tl.minimum((pid + 1) * BLOCK_R, NUM_GROUPS)
    row_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_R], tl.float32)
    for c0 in range(0, end_col, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_ok = cols < end_col
        last_k = tl.load(LAST + cols, mask=col_ok, other=-1)
        s = _stride_scores(Q, K, rows, cols, head, kv_head, row_ok, col_ok, first_q, last_k, qk_scale, T,
                           stride_qt, stride_qh, stride_kt, stride_kh, STRIDE, HEAD_DIM, BLOCK_R, BLOCK_C, BLOCK_D, NATIVE)
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        row_sum = row_sum * tl.exp2(row_max - safe_max) + tl.sum(tl.exp2(s - safe_max[:, None]), axis=1)
        row_max = new_max
    safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    has_keys = row_ok & (row_sum > 0)
    inv_sum = tl.where(has_keys, 1.0 / tl.where(row_sum > 0, row_sum, 1.0), 0.0)
    # Each stride row with keys sums to one: a query block's total is its number of such rows.
    rows_with_keys = tl.sum(tl.reshape(has_keys.to(tl.float32), (QBS, PER_BLOCK)), axis=1)
    inv_rows = 1.0 / tl.maximum(rows_with_keys, 1.0)
    qbs = pid * QBS + tl.arange(0, QBS)
    for c0 in range(0, end_col, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_ok = cols < end_col
        last_k = tl.load(LAST + cols, mask=col_ok, other=-1)
        s = _stride_scores(Q, K, rows, cols, head, kv_head, row_ok, col_ok, first_q, last_k, qk_scale, T,
                           stride_qt, stride_qh, stride_kt, stride_kh, STRIDE, HEAD_DIM, BLOCK_R, BLOCK_C, BLOCK_D, NATIVE)
        p = tl.exp2(s - safe_max[:, None]) * inv_sum[:, None]
        per_block = tl.sum(tl.sum(tl.reshape(p, (QBS, PER_BLOCK, KBS, PER_BLOCK)), axis=3), axis=1) * inv_rows[:, None]
        kbs = c0 // PER_BLOCK + tl.arange(0, KBS)
        keep = (kbs[None, :] <= qbs[:, None]) & (qbs[:, None] < NB)
        tl.store(MASS + (head * NB + qbs[:, None]) * NB + kbs[None, :], per_block, mask=keep)


def estimate_block_mass(
    q: torch.Tensor, k: torch.Tensor, doc: torch.Tensor, block_size: int, stride: int, scale: float
) -> torch.Tensor:
    """[Hq, nB, nB] fp32 estimated attention mass of each block, rows normalised over candidates (Triton)."""
    q, k = q.contiguous(), k.contiguous()
    num_tokens, num_q_heads, head_dim = q.shape
    nb = num_blocks(num_tokens, block_size)
    per_block = block_size // stride
    first, last = (x.to(torch.int32) for x in group_doc_range(doc, stride))
    mass = torch.zeros(num_q_heads, nb, nb, dtype=torch.float32, device=q.device)
    block_r = max(64, per_block)
    launch(
        _block_mass_kernel, (triton.cdiv(first.numel(), block_r), num_q_heads),
        q, k, first, last, mass,
        scale / stride * _LOG2E, num_tokens, first.numel(), nb,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        GROUP=num_q_heads // k.shape[1], STRIDE=stride, PER_BLOCK=per_block, HEAD_DIM=head_dim,
        BLOCK_R=block_r, BLOCK_C=max(64, per_block), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        NATIVE=q.is_cuda and q.dtype in (torch.float16, torch.bfloat16),
    )
    return mass


@triton.jit
def _rank_kernel(
    MASS, DOC, CU, ORDER, SORTED, CUMULATIVE, CANDIDATES, FORCED, T, NB,
    BLOCK: tl.constexpr, NBP: tl.constexpr, SINKS: tl.constexpr, LOCAL: tl.constexpr, BLOCK_BITS: tl.constexpr,
):
    """One program per (query block, query head): the row's candidates and always-kept blocks, its ranking by
    ``selection.rank_keys`` (one sort of NBP keys), and the masses in rank order with their running sum."""
    qb = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.arange(0, NBP)
    col_ok = cols < NB
    first_doc = tl.load(DOC + qb * BLOCK)
    last_doc = tl.load(DOC + tl.minimum(cols * BLOCK + BLOCK - 1, T - 1), mask=col_ok, other=-1)
    candidate = col_ok & (cols <= qb) & (first_doc <= last_doc)
    sink = tl.load(CU + first_doc) // BLOCK
    forced = candidate & ((qb - cols < LOCAL) | ((cols >= sink) & (cols < sink + SINKS)))
    row = (head * NB + qb) * NB
    mass = tl.load(MASS + row + cols, mask=candidate, other=0.0)
    key = ((forced.to(tl.int64) << 52) | (candidate.to(tl.int64) << 51)
           | (mass.to(tl.int32, bitcast=True).to(tl.int64) << 20) | (BLOCK_BITS - cols).to(tl.int64))
    order = BLOCK_BITS - (tl.sort(key, 0, descending=True) & BLOCK_BITS)
    num_candidates = tl.sum(candidate.to(tl.int64), 0)
    sorted_mass = tl.load(MASS + row + order, mask=cols < num_candidates, other=0.0)
    tl.store(ORDER + row + cols, order, mask=col_ok)
    tl.store(SORTED + row + cols, sorted_mass, mask=col_ok)
    tl.store(CUMULATIVE + row + cols, tl.cumsum(sorted_mass, 0), mask=col_ok)
    if head == 0:
        tl.store(CANDIDATES + qb, num_candidates)
        tl.store(FORCED + qb, tl.sum(forced.to(tl.int64), 0))


# Rows of more blocks than this are ranked by torch's sort: one program's sort would spill its registers.
_MAX_RANKED_BLOCKS = 4096


def rank_block_mass(mass: torch.Tensor, doc: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int,
                    sink_blocks: int, local_blocks: int, q_blocks: torch.Tensor | None = None) -> tuple:
    """``selection.rank_block_mass`` in one Triton launch (whole streams of at most ``_MAX_RANKED_BLOCKS``
    blocks; others go to torch)."""
    from .selection import _BLOCK_BITS, rank_block_mass as rank_torch

    num_q_heads, _, nb = mass.shape
    if q_blocks is not None or nb > _MAX_RANKED_BLOCKS:
        return rank_torch(mass, doc, cu_seqlens, block_size, sink_blocks, local_blocks, q_blocks)
    if local_blocks < 1 or sink_blocks < 0:
        raise ValueError(f"local_blocks must be >= 1 and sink_blocks >= 0, got {local_blocks} and {sink_blocks}")
    order = torch.empty(mass.shape, dtype=torch.int64, device=mass.device)
    sorted_mass, cumulative = torch.empty_like(mass), torch.empty_like(mass)
    candidates, forced = (torch.empty(nb, dtype=torch.int64, device=mass.device) for _ in range(2))
    padded = triton.next_power_of_2(nb)
    launch(
        _rank_kernel, (nb, num_q_heads),
        mass, doc, cu_seqlens, order, sorted_mass, cumulative, candidates, forced, doc.numel(), nb,
        BLOCK=block_size, NBP=padded, SINKS=sink_blocks, LOCAL=local_blocks, BLOCK_BITS=_BLOCK_BITS,
        num_warps=4 if padded <= 1024 else 8,
    )
    return candidates, forced, order, sorted_mass, cumulative
