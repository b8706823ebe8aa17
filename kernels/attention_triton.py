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

import functools
from collections.abc import Mapping
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from .launches import launch
from .layout import TileLayout, next_power_of_two

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
    Q, K, V, O, LSE, DOC, COUNT, INDEX,
    qk_scale, T, NB,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
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
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = _load(Q + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :], q_mask, UPCAST)
    doc_q = tl.load(DOC + offs_m, mask=m_ok, other=-1)
    kk = K + (head // GROUP) * stride_kh
    vv = V + (head // GROUP) * stride_vh
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row = head * NB + qb
    for i in range(0, tl.load(COUNT + row)):
        kb = tl.load(INDEX + row * NB + i)
        for n0 in range(0, BLOCK, BLOCK_N):
            offs_n = kb * BLOCK + n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < T
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = _load(kk + offs_n[:, None] * stride_kt + offs_d[None, :], kv_mask, UPCAST)
            v = _load(vv + offs_n[:, None] * stride_vt + offs_d[None, :], kv_mask, UPCAST)
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
    tl.store(O + offs_m[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty), mask=q_mask)
    lse2 = row_max + tl.log2(tl.where(has_keys, row_sum, 1.0))
    tl.store(LSE + head * T + offs_m, tl.where(has_keys, lse2 * _LN2, float("-inf")), mask=m_ok)

@triton.jit
def _dq_kernel(
    Q, K, V, O, DO, DQ, LSE, DELTA, DOC, COUNT, INDEX,
    qk_scale, scale, T, NB,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_dot, stride_doh,
    stride_dqt, stride_dqh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """dQ of one query sub-block and head; also stores its rows' delta = rowsum(O * dO), which the dK/dV
    kernel launched after it reads."""
    sub_blocks: tl.constexpr = BLOCK // BLOCK_M
    pid = tl.program_id(0)
    head = tl.program_id(1)
    qb = pid // sub_blocks
    offs_m = qb * BLOCK + (pid % sub_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < T
    d_ok = offs_d < HEAD_DIM
    q_mask = m_ok[:, None] & d_ok[None, :]
    rows = offs_m[:, None]
    q = _load(Q + rows * stride_qt + head * stride_qh + offs_d[None, :], q_mask, UPCAST)
    do = _load(DO + rows * stride_dot + head * stride_doh + offs_d[None, :], q_mask, UPCAST)
    o = tl.load(O + rows * stride_ot + head * stride_oh + offs_d[None, :], mask=q_mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + head * T + offs_m, delta, mask=m_ok)
    doc_q = tl.load(DOC + offs_m, mask=m_ok, other=-1)
    lse = _load_lse2(LSE + head * T + offs_m, m_ok)
    kk = K + (head // GROUP) * stride_kh
    vv = V + (head // GROUP) * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row = head * NB + qb
    for i in range(0, tl.load(COUNT + row)):
        kb = tl.load(INDEX + row * NB + i)
        for n0 in range(0, BLOCK, BLOCK_N):
            offs_n = kb * BLOCK + n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < T
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = _load(kk + offs_n[:, None] * stride_kt + offs_d[None, :], kv_mask, UPCAST)
            v = _load(vv + offs_n[:, None] * stride_vt + offs_d[None, :], kv_mask, UPCAST)
            doc_k = tl.load(DOC + offs_n, mask=n_ok, other=-2)
            p = tl.exp2(_scores(q, k, offs_m, offs_n, doc_q, doc_k, qk_scale, PRECISION) - lse[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + rows * stride_dqt + head * stride_dqh + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=q_mask)

@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, DKV, LSE, DELTA, DOC, COUNT, INDEX,
    qk_scale, scale, T, NB,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
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
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = _load(K + offs_n[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], kv_mask, UPCAST)
    v = _load(V + offs_n[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], kv_mask, UPCAST)
    doc_k = tl.load(DOC + offs_n, mask=n_ok, other=-2)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    row = head * NB + kb
    for i in range(0, tl.load(COUNT + row)):
        qb = tl.load(INDEX + row * NB + i)
        for m0 in range(0, BLOCK, BLOCK_M):
            offs_m = qb * BLOCK + m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < T
            q_mask = m_ok[:, None] & d_ok[None, :]
            q = _load(Q + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :], q_mask, UPCAST)
            do = _load(DO + offs_m[:, None] * stride_dot + head * stride_doh + offs_d[None, :], q_mask, UPCAST)
            doc_q = tl.load(DOC + offs_m, mask=m_ok, other=-1)
            lse = _load_lse2(LSE + head * T + offs_m, m_ok)
            delta = tl.load(DELTA + head * T + offs_m, mask=m_ok, other=0.0)
            p = tl.exp2(_scores(q, k, offs_m, offs_n, doc_q, doc_k, qk_scale, PRECISION) - lse[:, None])
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    # Per query head partials in DKV [2, T, Hq, D] (fp32, contiguous), summed over each KV group afterwards.
    num_heads = tl.num_programs(1)
    part = (offs_n[:, None] * num_heads + head) * HEAD_DIM + offs_d[None, :]
    tl.store(DKV + part, dk * scale, mask=kv_mask)
    tl.store(DKV + T * num_heads * HEAD_DIM + part, dv, mask=kv_mask)


def tile_columns(head_dim: int) -> int:
    """Columns of the q, k and v tiles: the head dimension padded to a power of two, at least 16 (``tl.dot``'s
    least)."""
    return max(16, next_power_of_two(head_dim))


def tile_rows(head_dim: int, dtype: torch.dtype) -> int:
    """Rows of the q, k or v tiles a program loads (a power of two, 16 to 64): as many as 16 KiB hold (64 rows of
    128 half-precision values), since larger tiles (wider heads, fp32) spill registers and outgrow the shared
    memory of GPUs."""
    return max(16, min(64, 16 * 1024 // (tile_columns(head_dim) * dtype.itemsize)))


def _launch_meta(q: torch.Tensor, layout: TileLayout) -> Mapping:
    return _launch_options(q.dtype, q.shape[-1], q.device.type, layout.block_size, layout.group_size)


@functools.cache  # worked out once per configuration, not on every launch
def _launch_options(dtype: torch.dtype, head_dim: int, device_type: str, block_size: int, group: int) -> Mapping:
    # fp32's exact products spill registers beyond 16 rows here
    tile = min(block_size, 16 if dtype == torch.float32 else tile_rows(head_dim, dtype))
    return MappingProxyType(dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK=block_size,
        BLOCK_M=tile,
        BLOCK_N=tile,
        BLOCK_D=tile_columns(head_dim),
        # fp32 inputs keep full precision (no TF32) so results match the reference to 1e-5.
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        UPCAST=dtype == torch.bfloat16 and device_type == "cpu",
        num_warps=4 if head_dim <= 64 else 8,  # with 4, wider heads spill registers on sm_80 and sm_90
        num_stages=3,  # fewer where the GPU's shared memory holds fewer (launches.launch)
    ))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [T, H, D] with unit stride along D, which the kernels need; other strides are passed to them."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _strides(*tensors: torch.Tensor) -> list[int]:
    return [stride for x in tensors for stride in x.stride()[:2]]


def _check_dtype(q: torch.Tensor) -> None:
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"the triton backend supports float32, float16 and bfloat16, got {q.dtype}")


def lse_like(q: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """An empty log-sum-exp of ``forward``'s shape and dtype."""
    return q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TileLayout, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [T, Hq, D] in q's dtype and the natural-log log-sum-exp [Hq, T] (-inf on rows with no key)."""
    _check_dtype(q)
    q, k, v = _rows(q), _rows(k), _rows(v)
    num_tokens, num_q_heads, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(num_q_heads, num_tokens, dtype=torch.float32, device=q.device)
    meta = _launch_meta(q, layout)
    grid = (layout.num_blocks * (layout.block_size // meta["BLOCK_M"]), num_q_heads)
    lists = layout.lists()
    launch(
        _fwd_kernel, grid,
        q, k, v, out, lse, layout.doc, lists.count, lists.index,
        scale * _LOG2E.value, num_tokens, layout.num_blocks, *_strides(q, k, v, out), **meta,
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
    q, k, v, out, grad_out = _rows(q), _rows(k), _rows(v), _rows(out), _rows(grad_out)
    num_tokens, num_q_heads, head_dim = q.shape
    delta = torch.empty(num_q_heads, num_tokens, dtype=torch.float32, device=q.device)
    dq = torch.empty_like(q)
    meta = _launch_meta(q, layout)
    common = (scale * _LOG2E.value, scale, num_tokens, layout.num_blocks)
    grid_q = (layout.num_blocks * (layout.block_size // meta["BLOCK_M"]), num_q_heads)
    doc, lists = layout.doc, layout.lists()
    launch(
        _dq_kernel, grid_q,
        q, k, v, out, grad_out, dq, lse, delta, doc, lists.count, lists.index,
        *common, *_strides(q, k, v, out, grad_out, dq), **meta,
    )
    # One program per (key sub-block, query head): a KV head's work split over its group keeps the
    # always-kept first block of a long document (visited by every query block) from serialising.
    dkv_part = torch.empty((2, *q.shape), dtype=torch.float32, device=q.device)
    grid_kv = (layout.num_blocks * (layout.block_size // meta["BLOCK_N"]), num_q_heads)
    lists = layout.lists(transposed=True)
    launch(
        _dkdv_kernel, grid_kv,
        q, k, v, grad_out, dkv_part, lse, delta, doc, lists.count, lists.index,
        *common, *_strides(q, k, v, grad_out), **meta,
    )
    dkv = dkv_part.view(2, num_tokens, k.shape[1], layout.group_size, head_dim).sum(dim=3).to(k.dtype)
    return dq, dkv[0], dkv[1]
