"""Triton version of the selection scoring: stride antidiagonal scores, softmax and block sums fused.

Same result as ``selection.estimate_block_mass`` without materialising the (T/S)^2 stride-level scores:
one program per run of query blocks and query head makes two passes over the causal key groups, the first for the
softmax max and normaliser of each stride row, the second to add the probabilities up per key block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_triton import tile_columns, tile_rows
from .launches import launch
from .layout import PackedDocuments, check_window, next_power_of_two, num_blocks

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
    Q, K, DOC, MASS,
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
    first_q = tl.load(DOC + rows * STRIDE, mask=row_ok, other=0)  # each stride group's first and last documents
    end_col = tl.minimum((pid + 1) * BLOCK_R, NUM_GROUPS)
    row_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_R], tl.float32)
    for c0 in range(0, end_col, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_ok = cols < end_col
        last_k = tl.load(DOC + tl.minimum(cols * STRIDE + STRIDE - 1, T - 1), mask=col_ok, other=-1)
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
        last_k = tl.load(DOC + tl.minimum(cols * STRIDE + STRIDE - 1, T - 1), mask=col_ok, other=-1)
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
    run = _block_mass_op if torch.compiler.is_compiling() else _block_mass
    return run(q, k, doc, block_size, stride, scale)


def _block_mass(q: torch.Tensor, k: torch.Tensor, doc: torch.Tensor, block_size: int, stride: int,
                scale: float) -> torch.Tensor:
    q, k = q.contiguous(), k.contiguous()
    num_tokens, num_q_heads, head_dim = q.shape
    nb = num_blocks(num_tokens, block_size)
    per_block = block_size // stride
    num_groups = num_blocks(num_tokens, stride)
    mass = torch.zeros(num_q_heads, nb, nb, dtype=torch.float32, device=q.device)
    block_r = max(tile_rows(head_dim, q.dtype), per_block)
    launch(
        _block_mass_kernel, (num_blocks(num_groups, block_r), num_q_heads),
        q, k, doc, mass,
        scale / stride * _LOG2E, num_tokens, num_groups, nb,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        GROUP=num_q_heads // k.shape[1], STRIDE=stride, PER_BLOCK=per_block, HEAD_DIM=head_dim,
        BLOCK_R=block_r, BLOCK_C=block_r, BLOCK_D=tile_columns(head_dim),
        # tensor cores wherever the kernel is compiled (CPU tensors run only under the interpreter)
        NATIVE=q.device.type != "cpu" and q.dtype in (torch.float16, torch.bfloat16),
        num_warps=4 if head_dim <= 64 else 8,  # with 4, wider heads spill registers on sm_80
        num_stages=3,  # fewer where the GPU's shared memory holds fewer (launches.launch)
    )
    return mass


# Under torch.compile the selection's launches run as custom ops, which it calls without tracing them, knowing only
# their outputs' shapes (as the attention's, ``attention.py``); budgets enter them as host tensors, so that a new
# budget compiles nothing again.
_block_mass_op = torch.library.custom_op(
    "sparsebalance::triton_block_mass", _block_mass, mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor doc, int block_size, int stride, float scale) -> Tensor",
)


@_block_mass_op.register_fake
def _(q, k, doc, block_size, stride, scale):
    nb = num_blocks(q.shape[0], block_size)
    return q.new_empty(q.shape[1], nb, nb, dtype=torch.float32)


def _host_tensor(values: list) -> torch.Tensor:
    """float64 [len(values)] on the host, from numbers a compiled caller holds as symbols (a budget's): built by
    arithmetic, which torch.compile keeps symbolic, where ``torch.tensor`` of them would compile again for every new
    value."""
    basis = torch.eye(len(values), dtype=torch.float64, device="cpu")
    return sum((basis[i] * value for i, value in enumerate(values)), basis.new_zeros(len(values)))


@triton.jit
def _row_count(cumulative, row_mass, cols, num_candidates, num_forced, tau, cap, NB):
    """``selection._kept_counts`` of one row for one budget: the top-p count at ``tau`` (tau >= 1 keeps every
    candidate), between the forced blocks and the candidates, then the cap (``cap`` > 1: none)."""
    below = tl.sum(((cumulative < tau * row_mass) & (cols < NB)).to(tl.int64), 0) + 1
    count = tl.where(tau >= 1.0, num_candidates, below)
    count = tl.minimum(tl.maximum(count, num_forced), num_candidates)
    limit = tl.maximum(num_forced, tl.floor(cap * num_candidates.to(tl.float32)).to(tl.int64))
    return tl.where(cap <= 1.0, tl.minimum(count, limit), count)


@triton.jit
def _rank_kernel(
    MASS, DOC, CU, ORDER, SORTED, CUMULATIVE, CANDIDATES, FORCED, KEPT, KEPT_MASS, MASK, OPTIONAL, DOC_TILES,
    T, NB, NUM_DOCS, TAU0, CAP0, TAU1, CAP1,
    BLOCK: tl.constexpr, NBP: tl.constexpr, SINKS: tl.constexpr, LOCAL: tl.constexpr, BLOCK_BITS: tl.constexpr,
    BUDGETS: tl.constexpr, WRITE_MASK: tl.constexpr, WRITE_OPTIONAL: tl.constexpr,
):
    """One program per (query block, query head): the row's candidates and always-kept blocks, its ranking by
    ``selection.rank_keys`` (one sort of NBP keys), and the masses in rank order with their running sum; then,
    for up to two budgets (tau, cap), the row's kept count and kept share of its mass, and for the first budget
    its mask row or the masses of its optional blocks (-1 elsewhere, what a tile bound cuts from) when asked. The
    last budget's kept tiles and the candidate tiles of all heads are added up per document (the document of the
    query block's first token), into DOC_TILES [2, docs]."""
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
    num_forced = tl.sum(forced.to(tl.int64), 0)
    sorted_mass = tl.load(MASS + row + order, mask=cols < num_candidates, other=0.0)
    cumulative = tl.cumsum(sorted_mass, 0)
    tl.store(ORDER + row + cols, order, mask=col_ok)
    tl.store(SORTED + row + cols, sorted_mass, mask=col_ok)
    tl.store(CUMULATIVE + row + cols, cumulative, mask=col_ok)
    if head == 0:
        tl.store(CANDIDATES + qb, num_candidates)
        tl.store(FORCED + qb, num_forced)
    row_mass = tl.sum(tl.where(cols == NB - 1, cumulative, 0.0), 0)
    rows = tl.num_programs(1) * NB
    if BUDGETS >= 1:
        count = _row_count(cumulative, row_mass, cols, num_candidates, num_forced, TAU0, CAP0, NB)
        tl.store(KEPT + head * NB + qb, count)
        tl.store(KEPT_MASS + head * NB + qb, tl.sum(tl.where(cols == count - 1, cumulative, 0.0), 0) / row_mass)
        if WRITE_MASK:
            tl.store(MASK + row + order, cols < count, mask=col_ok)
        if WRITE_OPTIONAL:
            tl.store(OPTIONAL + row + cols, tl.where((cols >= num_forced) & (cols < count), sorted_mass, -1.0),
                     mask=col_ok)
    if BUDGETS >= 2:
        count = _row_count(cumulative, row_mass, cols, num_candidates, num_forced, TAU1, CAP1, NB)
        tl.store(KEPT + rows + head * NB + qb, count)
        tl.store(KEPT_MASS + rows + head * NB + qb,
                 tl.sum(tl.where(cols == count - 1, cumulative, 0.0), 0) / row_mass)
    if BUDGETS >= 1:
        tl.atomic_add(DOC_TILES + first_doc, count.to(tl.int32))
        if head == 0:
            tl.atomic_add(DOC_TILES + NUM_DOCS + first_doc, (num_candidates * tl.num_programs(1)).to(tl.int32))


# Rows of more blocks than this are ranked by torch's sort: one program's sort would spill its registers.
_MAX_RANKED_BLOCKS = 4096


def rank_block_mass(mass: torch.Tensor, documents: PackedDocuments, sink_blocks: int, local_blocks: int,
                    q_blocks: torch.Tensor | None = None, budgets: tuple = (), first: str | None = None) -> tuple:
    """``selection.rank_block_mass`` in one Triton launch (whole streams of at most ``_MAX_RANKED_BLOCKS``
    blocks; others go to torch), which also applies up to two ``budgets`` (tau, max_density) to every row:
    returns the ranking's fields and a ``KnownBudget`` per budget, in their order, the first budget's with its mask
    (``first`` = "mask") or its optional blocks' masses (``first`` = "optional", for a tile bound: ``cut_to_tiles``),
    the last one's with its kept and candidate tiles per document (the base budget's, whose densities predict
    costs)."""
    from .selection import KnownBudget, rank_block_mass as rank_torch

    if q_blocks is not None or mass.shape[-1] > _MAX_RANKED_BLOCKS:
        return rank_torch(mass, documents, sink_blocks, local_blocks, q_blocks)
    check_window(sink_blocks, local_blocks)
    first = first if budgets else None  # what the first budget keeps: none without budgets
    taus_caps = [x for tau, cap in budgets for x in (tau, 2.0 if cap is None else cap)]
    if torch.compiler.is_compiling():
        run, taus_caps = _rank_op, _host_tensor(taus_caps)
    else:
        run = _rank
    candidates, forced, order, sorted_mass, cumulative, kept, kept_mass, mask, optional, document_tiles = run(
        mass, documents.doc, documents.cu_seqlens, documents.block_size, sink_blocks, local_blocks, taus_caps,
        first or "")
    known = [KnownBudget(kept[i], kept_mass[i]) for i in range(len(budgets))]
    if budgets:
        known[-1] = known[-1]._replace(document_tiles=document_tiles)
        if first is not None:
            known[0] = known[0]._replace(mask=mask if first == "mask" else None,
                                         optional=optional if first == "optional" else None)
    return candidates, forced, order, sorted_mass, cumulative, tuple(known)


def _rank(mass: torch.Tensor, doc: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int, sink_blocks: int,
          local_blocks: int, taus_caps: list[float], first: str) -> tuple[torch.Tensor, ...]:
    """The ranking kernel's launch: (candidates, forced, order, sorted_mass, cumulative, kept, kept_mass, mask,
    optional, document_tiles), the mask and the optional masses empty where ``first`` asks for neither."""
    from .selection import _BLOCK_BITS

    num_q_heads, _, nb = mass.shape
    num_budgets = len(taus_caps) // 2
    device = mass.device
    order = torch.empty(mass.shape, dtype=torch.int64, device=device)
    sorted_mass, cumulative = torch.empty_like(mass), torch.empty_like(mass)
    candidates, forced = (torch.empty(nb, dtype=torch.int64, device=device) for _ in range(2))
    kept = torch.empty(num_budgets, num_q_heads, nb, dtype=torch.int64, device=device)
    kept_mass = torch.empty(num_budgets, num_q_heads, nb, dtype=torch.float32, device=device)
    mask, optional = _first_outputs(mass, first)
    num_docs = cu_seqlens.numel() - 1
    document_tiles = torch.zeros(2, num_docs, dtype=torch.int32, device=device)
    padded = next_power_of_two(nb)
    launch(
        _rank_kernel, (nb, num_q_heads),
        mass, doc, cu_seqlens, order, sorted_mass, cumulative, candidates, forced, kept, kept_mass,
        mask if first == "mask" else kept, optional if first == "optional" else kept_mass,  # unwritten otherwise
        document_tiles, doc.numel(), nb, num_docs, *(map(float, taus_caps)), *[1.0, 2.0] * (2 - num_budgets),
        BLOCK=block_size, NBP=padded, SINKS=sink_blocks, LOCAL=local_blocks, BLOCK_BITS=_BLOCK_BITS,
        BUDGETS=num_budgets, WRITE_MASK=first == "mask", WRITE_OPTIONAL=first == "optional",
        num_warps=4 if padded <= 1024 else 8,
    )
    return candidates, forced, order, sorted_mass, cumulative, kept, kept_mass, mask, optional, document_tiles


def _first_outputs(mass: torch.Tensor, first: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The first budget's mask and optional masses as ``_rank`` returns them: full size where ``first`` asks."""
    mask = mass.new_empty(mass.shape if first == "mask" else (0,), dtype=torch.bool)
    return mask, mass.new_empty(mass.shape if first == "optional" else (0,))


def _rank_at_host_budgets(mass, doc, cu_seqlens, block_size, sink_blocks, local_blocks, taus_caps, first):
    return _rank(mass, doc, cu_seqlens, block_size, sink_blocks, local_blocks, taus_caps.tolist(), first)


_rank_op = torch.library.custom_op(
    "sparsebalance::triton_rank_block_mass", _rank_at_host_budgets, mutates_args=(),
    schema="(Tensor mass, Tensor doc, Tensor cu_seqlens, int block_size, int sink_blocks, int local_blocks, "
           "Tensor taus_caps, str first) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
           "Tensor)",
)


@_rank_op.register_fake
def _(mass, doc, cu_seqlens, block_size, sink_blocks, local_blocks, taus_caps, first):
    num_q_heads, _, nb = mass.shape
    num_budgets = taus_caps.shape[0] // 2
    rows = mass.new_empty(num_budgets, num_q_heads, nb)
    return (mass.new_empty(nb, dtype=torch.int64), mass.new_empty(nb, dtype=torch.int64),
            mass.new_empty(mass.shape, dtype=torch.int64), torch.empty_like(mass), torch.empty_like(mass),
            rows.long(), rows, *_first_outputs(mass, first),
            mass.new_empty(2, cu_seqlens.shape[0] - 1, dtype=torch.int32))


@triton.jit
def _cut_kernel(
    ORDER, CUMULATIVE, FORCED, OPTIONAL, ORDERED, BASE_TILES, CUT, CUT_MASS, MASK, NB, NUM_DOCS, NUM_OPTIONAL, SCALE,
    NBP: tl.constexpr, DOCS_PER_STEP: tl.constexpr,
):
    """One program per (query block, query head): the row's kept blocks under ``SCALE`` times the base budget's tiles
    of the layer (their count per document in BASE_TILES), ``BlockRanking._within`` in one launch. Every program
    finds the bound's mass threshold, the first mass the bound drops among the layer's optional blocks in
    decreasing order (``ORDERED``), and keeps the forced blocks and the optional ones above it; then the row's
    kept share of its mass and its mask row."""
    qb = tl.program_id(0)
    head = tl.program_id(1)
    blocks = tl.arange(0, NBP)
    base_tiles = tl.zeros([DOCS_PER_STEP], tl.int64)
    for d0 in range(0, NUM_DOCS, DOCS_PER_STEP):
        docs = d0 + tl.arange(0, DOCS_PER_STEP)
        base_tiles += tl.load(BASE_TILES + docs, mask=docs < NUM_DOCS, other=0).to(tl.int64)
    max_tiles = tl.floor(SCALE * tl.sum(base_tiles, 0).to(tl.float32)).to(tl.int64)
    forced_tiles = tl.sum(tl.load(FORCED + blocks, mask=blocks < NB, other=0), 0) * tl.num_programs(1)
    spare = tl.minimum(tl.maximum(max_tiles - forced_tiles, 0), NUM_OPTIONAL - 1)
    threshold = tl.load(ORDERED + spare)
    row = (head * NB + qb) * NB
    optional = tl.load(OPTIONAL + row + blocks, mask=blocks < NB, other=-1.0)
    count = tl.load(FORCED + qb) + tl.sum((optional > threshold).to(tl.int64), 0)
    cumulative = tl.load(CUMULATIVE + row + blocks, mask=blocks < NB, other=0.0)
    row_mass = tl.sum(tl.where(blocks == NB - 1, cumulative, 0.0), 0)
    tl.store(CUT + head * NB + qb, count)
    tl.store(CUT_MASS + head * NB + qb, tl.sum(tl.where(blocks == count - 1, cumulative, 0.0), 0) / row_mass)
    order = tl.load(ORDER + row + blocks, mask=blocks < NB, other=0)
    tl.store(MASK + row + order, blocks < count, mask=blocks < NB)


def cut_to_tiles(ranking, known, scale: float, base_tiles: torch.Tensor) -> tuple:
    """(kept [Hq, nB], kept share of each row's mass, mask) of a budget the ranking kernel applied with its optional
    masses (``known``), its rows cut to ``scale`` times the base budget's tiles of the layer (``base_tiles``: per
    document): one sort and one launch."""
    if torch.compiler.is_compiling():
        run, scale = _cut_op, _host_tensor([scale])
    else:
        run = _cut
    return run(ranking.order, ranking.cumulative, ranking.forced, known.optional, base_tiles, scale)


def _cut(order: torch.Tensor, cumulative: torch.Tensor, forced: torch.Tensor, optional: torch.Tensor,
         base_tiles: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_q_heads, nb, _ = order.shape
    ordered = optional.flatten().sort(descending=True).values
    cut = order.new_empty(num_q_heads, nb)
    cut_mass = cumulative.new_empty(num_q_heads, nb)
    mask = torch.empty(order.shape, dtype=torch.bool, device=cut.device)
    launch(
        _cut_kernel, (nb, num_q_heads),
        order, cumulative, forced, optional, ordered, base_tiles, cut, cut_mass, mask,
        nb, base_tiles.numel(), ordered.numel(), float(scale), NBP=next_power_of_two(nb), DOCS_PER_STEP=128,
        num_warps=4 if nb <= 1024 else 8,
    )
    return cut, cut_mass, mask


def _cut_at_host_scale(order, cumulative, forced, optional, base_tiles, scale):
    return _cut(order, cumulative, forced, optional, base_tiles, scale.item())


_cut_op = torch.library.custom_op(
    "sparsebalance::triton_cut_to_tiles", _cut_at_host_scale, mutates_args=(),
    schema="(Tensor order, Tensor cumulative, Tensor forced, Tensor optional, Tensor base_tiles, Tensor scale) -> "
           "(Tensor, Tensor, Tensor)",
)


@_cut_op.register_fake
def _(order, cumulative, forced, optional, base_tiles, scale):
    num_q_heads, nb, _ = order.shape
    mask = order.new_empty(order.shape, dtype=torch.bool)
    return order.new_empty(num_q_heads, nb), cumulative.new_empty(num_q_heads, nb), mask
