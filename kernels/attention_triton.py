"""Block-sparse attention in Triton: flash-attention style forward and backward over the kept tiles only.

Each program owns a sub-block of queries (forward, dq) or of keys (dk, dv) and walks a CSR list of kept
tiles: per query block the kept key blocks, and for dk/dv the transposed lists (per key block and query
head the query blocks that kept it; fp32 partials per query head are summed over the KV group), so each
output is written once without atomics and the gradients are deterministic. Causal and document masking
is applied token by token inside each tile; softmax statistics are fp32 in base 2 inside the kernels, while
the log-sum-exp the forward stores (and the backward reads back to recompute probabilities) is natural-log
like every backend's, so ring attention merges either backend's partial results the same way.
Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (how the tests exercise it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import TileLayout

# Kernel constants (Triton reads only constexpr globals): the stored natural-log lse times _LOG2E is the
# kernels' base-2 lse, and a base-2 lse times _LN2 is natural-log.
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)

@triton.jit
def _load(ptrs, mask, UPCAST: tl.constexpr):
    """A masked tile load; UPCAST works around the interpreter's wrong bfloat16 ``tl.dot`` (triton 3.8)."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _load_lse2(ptrs, mask):
    """The stored natural-log lse in base 2, as the kernels' exp2 needs; rows with nothing allowed (-inf)
    become +inf so their probabilities are 0."""
    lse = tl.load(ptrs, mask=mask, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)


@triton.jit
def _scores(q, k, offs_m, offs_n, doc_q, doc_k, qk_scale, PRECISION: tl.constexpr):
    """Scaled base-2 logits of one tile with disallowed pairs (other document, future, padding) at -inf."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    allowed = (offs_n[None, :] <= offs_m[:, None]) & (doc_q[:, None] == doc_k[None, :])
    return tl.where(allowed, s, float("-inf"))

@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, DOC, ROW_PTR, COLS,
    qk_scale, T, NB,
    stride_qt, stride_qh, stride_kt, stride_kh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    sub_blocks: tl.constexpr = BLOCK // BLOCK_M
    pid = tl.program_id(0)
    head = tl.program_id(1)
    qb = pid // sub_blocks
    offs_m = qb * BLOCK + (pid % sub_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < T
    d_ok = offs_d < HEAD_DIM
    q_ptrs = offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = _load(Q + q_ptrs, q_mask, UPCAST)
    doc_q = tl.load(DOC + offs_m, mask=m_ok, other=-1)
    kv = K + (head // GROUP) * stride_kh
    vv = V + (head // GROUP) * stride_kh
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    start = tl.load(ROW_PTR + head * NB + qb)
    end = tl.load(ROW_PTR + head * NB + qb + 1)
    for i in range(start, end):
        kb = tl.load(COLS + i)
        for n0 in range(0, BLOCK, BLOCK_N):
            offs_n = kb * BLOCK + n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < T
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = _load(kv + offs_n[:, None] * stride_kt + offs_d[None, :], kv_mask, UPCAST)
            v = _load(vv + offs_n[:, None] * stride_kt + offs_d[None, :], kv_mask, UPCAST)
            doc_k = tl.load(DOC + offs_n, mask=n_ok, other=-2)
            s = _scores(q, k, offs_m, offs_n, doc_q, doc_k, qk_scale, PRECISION)
            new_max = tl.maximum(row_max, tl.max(s, axis=1))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            p = tl.exp2(s - safe_max[:, None])
            alpha = tl.exp2(row_max - safe_max)
            row_sum = row_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            row_max = new_max
    has_keys = row_sum > 0
    out = acc / tl.where(has_keys, row_sum, 1.0)[:, None]
    tl.store(O + q_ptrs, out.to(O.dtype.element_ty), mask=q_mask)
    lse2 = row_max + tl.log2(tl.where(has_keys, row_sum, 1.0))
    tl.store(LSE + head * T + offs_m, tl.where(has_keys, lse2 * _LN2, float("-inf")), mask=m_ok)

@triton.jit
def _dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, DOC, ROW_PTR, COLS,
    qk_scale, scale, T, NB,
    stride_qt, stride_qh, stride_kt, stride_kh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    sub_blocks: tl.constexpr = BLOCK // BLOCK_M
    pid = tl.program_id(0)
    head = tl.program_id(1)
    qb = pid // sub_blocks
    offs_m = qb * BLOCK + (pid % sub_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < T
    d_ok = offs_d < HEAD_DIM
    q_ptrs = offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = _load(Q + q_ptrs, q_mask, UPCAST)
    do = _load(DO + q_ptrs, q_mask, UPCAST)
    doc_q = tl.load(DOC + offs_m, mask=m_ok, other=-1)
    lse = _load_lse2(LSE + head * T + offs_m, m_ok)
    delta = tl.load(DELTA + head * T + offs_m, mask=m_ok, other=0.0)
    kv = K + (head // GROUP) * stride_kh
    vv = V + (head // GROUP) * stride_kh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    start = tl.load(ROW_PTR + head * NB + qb)
    end = tl.load(ROW_PTR + head * NB + qb + 1)
    for i in range(start, end):
        kb = tl.load(COLS + i)
        for n0 in range(0, BLOCK, BLOCK_N):
            offs_n = kb * BLOCK + n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < T
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = _load(kv + offs_n[:, None] * stride_kt + offs_d[None, :], kv_mask, UPCAST)
            v = _load(vv + offs_n[:, None] * stride_kt + offs_d[None, :], kv_mask, UPCAST)
            doc_k = tl.load(DOC + offs_n, mask=n_ok, other=-2)
            p = tl.exp2(_scores(q, k, offs_m, offs_n, doc_q, doc_k, qk_scale, PRECISION) - lse[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + q_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)

@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, DOC, COL_PTR, ROWS,
    qk_scale, scale, T, NB,
    stride_qt, stride_qh, stride_kt, stride_kh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    sub_blocks: tl.constexpr = BLOCK // BLOCK_N
    pid = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    kb = pid // sub_blocks
    offs_n = kb * BLOCK + (pid % sub_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < T
    d_ok = offs_d < HEAD_DIM
    kv_ptrs = offs_n[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = _load(K + kv_ptrs, kv_mask, UPCAST)
    v = _load(V + kv_ptrs, kv_mask, UPCAST)
    doc_k = tl.load(DOC + offs_n, mask=n_ok, other=-2)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    start = tl.load(COL_PTR + head * NB + kb)
    end = tl.load(COL_PTR + head * NB + kb + 1)
    for i in range(start, end):
        qb = tl.load(ROWS + i)
        for m0 in range(0, BLOCK, BLOCK_M):
            offs_m = qb * BLOCK + m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < T
            q_ptrs = offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
            q_mask = m_ok[:, None] & d_ok[None, :]
            q = _load(Q + q_ptrs, q_mask, UPCAST)
            do = _load(DO + q_ptrs, q_mask, UPCAST)
            doc_q = tl.load(DOC + offs_m, mask=m_ok, other=-1)
            lse = _load_lse2(LSE + head * T + offs_m, m_ok)
            delta = tl.load(DELTA + head * T + offs_m, mask=m_ok, other=0.0)
            p = tl.exp2(_scores(q, k, offs_m, offs_n, doc_q, doc_k, qk_scale, PRECISION) - lse[:, None])
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    # Per query head partials ([T, Hq, D] fp32, q's layout), summed over each KV group afterwards.
    part_ptrs = offs_n[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    tl.store(DK + part_ptrs, dk * scale, mask=kv_mask)
    tl.store(DV + part_ptrs, dv, mask=kv_mask)

def _launch_meta(q: torch.Tensor, layout: TileLayout) -> dict:
    tile = min(layout.block_size, 64)
    return dict(
        GROUP=layout.group_size,
        HEAD_DIM=q.shape[-1],
        BLOCK=layout.block_size,
        BLOCK_M=tile,
        BLOCK_N=tile,
        BLOCK_D=max(16, triton.next_power_of_2(q.shape[-1])),
        # fp32 inputs keep full precision (no TF32) so results match the reference to 1e-5.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.dtype == torch.bfloat16 and q.device.type == "cpu",
        num_warps=4,
    )

def _strides(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int]:
    return q.stride(0), q.stride(1), k.stride(0), k.stride(1)

def _check_dtype(q: torch.Tensor) -> None:
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"the triton backend supports float32, float16 and bfloat16, got {q.dtype}")

def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TileLayout, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [T, Hq, D] in q's dtype and the natural-log log-sum-exp [Hq, T] (-inf on rows with no key)."""
    _check_dtype(q)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    num_tokens, num_q_heads, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(num_q_heads, num_tokens, dtype=torch.float32, device=q.device)
    meta = _launch_meta(q, layout)
    grid = (layout.num_blocks * (layout.block_size // meta["BLOCK_M"]), num_q_heads)
    _fwd_kernel[grid](
        q, k, v, out, lse, layout.doc.to(torch.int32), layout.row_ptr.to(torch.int32), layout.tile_col.to(torch.int32),
        scale * _LOG2E.value, num_tokens, layout.num_blocks, *_strides(q, k), **meta,
    )
    return out, lse

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
    """dq from the kept key blocks of each query block; dk and dv from the transposed lists."""
    q, k, v, grad_out = q.contiguous(), k.contiguous(), v.contiguous(), grad_out.contiguous()
    num_tokens, num_q_heads, _ = q.shape
    delta = (out.float() * grad_out.float()).sum(dim=-1).transpose(0, 1).contiguous()  # [Hq, T]
    doc = layout.doc.to(torch.int32)
    dq = torch.empty_like(q)
    meta = _launch_meta(q, layout)
    common = (scale * _LOG2E.value, scale, num_tokens, layout.num_blocks, *_strides(q, k))
    grid_q = (layout.num_blocks * (layout.block_size // meta["BLOCK_M"]), num_q_heads)
    _dq_kernel[grid_q](
        q, k, v, grad_out, dq, lse, delta, doc, layout.row_ptr.to(torch.int32), layout.tile_col.to(torch.int32),
        *common, **meta,
    )
    col_ptr, rows = layout.transposed()
    # One program per (key sub-block, query head): a KV head's work split over its group keeps the
    # always-kept first block of a long document (visited by every query block) from serialising.
    dk_part = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dv_part = torch.empty_like(dk_part)
    grid_kv = (layout.num_blocks * (layout.block_size // meta["BLOCK_N"]), num_q_heads)
    _dkdv_kernel[grid_kv](
        q, k, v, grad_out, dk_part, dv_part, lse, delta, doc, col_ptr.to(torch.int32), rows.to(torch.int32),
        *common, **meta,
    )
    group_shape = (num_tokens, k.shape[1], layout.group_size, q.shape[-1])
    dk = dk_part.view(group_shape).sum(dim=2).to(k.dtype)
    dv = dv_part.view(group_shape).sum(dim=2).to(v.dtype)
    return dq, dk, dv
