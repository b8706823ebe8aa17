"""Block-sparse attention in plain torch (the CPU backend): forward and hand-written backward.

Work is proportional to the kept tiles. Rows (query head, query block) are sorted by their number of kept
key blocks and cut into chunks; in a chunk every row gathers its kept K/V blocks side by side (padded to
the chunk's longest row with a dummy block that masks itself out), so each row is one [B, D] x [D, n*B]
matmul and one row-wise exponential, with no scatter across tiles and no T x T matrix. Only tiles that need
it (diagonal, document boundaries, padding) get a token-level mask. The backward recomputes probabilities
as exp(s - lse) from the forward's lse, in key-major layout so that the dK/dV partials come out tile by
tile from untransposed matmuls. K is scaled once instead of q (a GQA group's q is several times larger),
which also makes dS @ K the finished dQ.

q and dO are cut into blocks once per call; each chunk gathers its rows of them and writes its rows of
the output and dQ straight into token layout (so this work too is shared by the workers), and each worker
reuses its scratch buffers from chunk to chunk. With several torch threads the chunks are shared among
that many Python threads running single-threaded ops: these many small ops scale much better across
chunks than inside each op. The rest of a call runs single-threaded too (see ``single_threaded``).
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .layout import TileLayout, single_threaded

# Score elements (rows x B x kept keys) per chunk: small enough for a chunk's buffers to stay in cache,
# large enough to amortise the per-chunk operator overhead (2^19 measured best against 2^17..2^21).
_CHUNK_ELEMENTS = 1 << 19


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _to_blocks(x: torch.Tensor, layout: TileLayout, dtype: torch.dtype, extra_block: bool = False) -> torch.Tensor:
    """[T, H, D] -> contiguous [H * (nB (+1)), B, D] in ``dtype``, zero-padded to whole blocks (plus an
    optional all-zero dummy block per head, the target of padded slots)."""
    num_tokens, heads, head_dim = x.shape
    blocks = layout.num_blocks + int(extra_block)
    x = x.to(dtype)
    padding = blocks * layout.block_size - num_tokens
    x = torch.cat([x, x.new_zeros(padding, heads, head_dim)]) if padding else x
    x = x.reshape(blocks, layout.block_size, heads, head_dim).permute(2, 0, 1, 3)
    return x.reshape(-1, layout.block_size, head_dim)


def _unblock(x: torch.Tensor, layout: TileLayout, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``_to_blocks`` with the extra block: [H * (nB + 1), B, D] -> [T, H, D]."""
    head_dim = x.shape[-1]
    x = x.view(heads, -1, layout.block_size, head_dim)[:, : layout.num_blocks]
    x = x.reshape(heads, layout.num_blocks * layout.block_size, head_dim)
    return x[:, : layout.num_tokens].transpose(0, 1).to(dtype).contiguous()


@dataclass
class _Chunk:
    rows: torch.Tensor  # [R] global rows h * nB + qb (a slice of the plan's row order)
    head: torch.Tensor  # [R] their query head h
    block: torch.Tensor  # [R] and query block qb
    kv_slots: torch.Tensor  # [R, n] indices into the flattened [Hkv * (nB + 1)] K/V blocks
    mask_row: torch.Tensor  # [M] local row of each tile needing a token mask
    mask_slot: torch.Tensor  # [M] its slot
    blocked: torch.Tensor  # [M, B, B] True where the pair is not allowed


@dataclass
class _Plan:
    num_rows: int  # rows with kept tiles; chunks hold them in order of decreasing kept count
    chunks: list[_Chunk]


def _plan(layout: TileLayout) -> _Plan:
    """Built once per layout, shared by forward and backward."""
    if "torch_plan" not in layout.scratch:
        layout.scratch["torch_plan"] = _build_plan(layout)
    return layout.scratch["torch_plan"]


def _build_plan(layout: TileLayout) -> _Plan:
    """Every chunk's slot lists and token masks come from a few whole-stream ops sliced per chunk, and each
    token mask is computed once per distinct (query block, key block) and shared by the heads: building
    them chunk by chunk and head by head cost about 5% of a forward and backward."""
    block, nb, device = layout.block_size, layout.num_blocks, layout.tiles.device
    csr = layout.rows()
    counts = csr.row_ptr[1:] - csr.row_ptr[:-1]
    order = torch.argsort(counts, descending=True, stable=True)
    widths = counts[order].tolist()
    active = sum(1 for c in widths if c > 0)
    order = order[:active]
    if active == 0:
        return _Plan(0, [])
    # Chunks of consecutive sorted rows, every row padded to its chunk's first (widest) row.
    bounds, start = [], 0
    while start < active:
        stop = min(start + max(1, _CHUNK_ELEMENTS // (widths[start] * block * block)), active)
        bounds.append((start, stop, widths[start]))
        start = stop
    starts, stops, chunk_widths = (torch.tensor(column, device=device) for column in zip(*bounds))
    sizes = stops - starts
    row_width = torch.repeat_interleave(chunk_widths, sizes)
    row_local = torch.arange(active, device=device) - torch.repeat_interleave(starts, sizes)
    # One element per (row, slot), rows in plan order, so that each chunk's elements are contiguous.
    row_end = torch.cumsum(row_width, 0)
    elem_row = torch.repeat_interleave(torch.arange(active, device=device), row_width)
    slot = torch.arange(int(row_end[-1]), device=device) - (row_end - row_width)[elem_row]
    rows = order[elem_row]
    valid = slot < counts[rows]
    tile = torch.where(valid, csr.row_ptr[rows] + slot, 0)
    full = valid & ~csr.tile_partial[tile]
    kb = torch.where(valid, csr.tile_col[tile], nb)
    kv_slots = ((rows // nb) // layout.group_size) * (nb + 1) + kb
    # Token masks of the tiles that need one (partial tiles and padding slots), once per distinct tile.
    masked = torch.nonzero(~full).squeeze(1)
    tiles, which = torch.unique((rows[masked] % nb) * (nb + 1) + kb[masked], return_inverse=True)
    pad = (nb + 1) * block - layout.num_tokens
    doc_q = torch.cat([layout.doc, layout.doc.new_full((pad,), -1)])
    doc_k = torch.cat([layout.doc, layout.doc.new_full((pad,), -2)])  # padding and dummy never match
    offs = torch.arange(block, device=device)
    qpos = (tiles // (nb + 1))[:, None] * block + offs
    kpos = (tiles % (nb + 1))[:, None] * block + offs
    allowed = (doc_q[qpos][:, :, None] == doc_k[kpos][:, None, :]) & (kpos[:, None, :] <= qpos[:, :, None])
    # Slice per chunk: masked elements come sorted by element.
    elem_cut = torch.cat([row_end.new_zeros(1), row_end[stops - 1]])
    mask_cut = torch.searchsorted(masked, elem_cut).tolist()
    elem_cut = elem_cut.tolist()
    mask_row, mask_slot, blocked = row_local[elem_row[masked]], slot[masked], (~allowed)[which]
    head, qb = order // nb, order % nb
    chunks = []
    for i, (a, b, width) in enumerate(bounds):
        m = slice(mask_cut[i], mask_cut[i + 1])
        slots = kv_slots[elem_cut[i] : elem_cut[i + 1]].view(b - a, width)
        chunks.append(_Chunk(order[a:b], head[a:b], qb[a:b], slots, mask_row[m], mask_slot[m], blocked[m]))
    return _Plan(active, chunks)


class _Workspace:
    """One worker's scratch buffers, reused chunk after chunk: fresh multi-megabyte tensors per op would
    be cold in cache (and page-faulted in) on every chunk."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self.buffers[name] = like.new_empty(numel)
        return buf[:numel].view(shape)


def _scores(
    chunk: _Chunk, q_rows: torch.Tensor, k_cols: torch.Tensor, out: torch.Tensor, key_major: bool
) -> torch.Tensor:
    """Scores of each row against its gathered key blocks, disallowed pairs at -inf: [R, B, n * B], or
    [R, n * B, B] when ``key_major`` (the backward's layout)."""
    block = q_rows.shape[1]
    if key_major:
        s = torch.bmm(k_cols, q_rows.transpose(1, 2), out=out)
        if chunk.mask_row.numel():
            tiles, which = s.view(-1, block, block), chunk.mask_row * chunk.kv_slots.shape[1] + chunk.mask_slot
            tiles.index_copy_(0, which, tiles.index_select(0, which).masked_fill_(chunk.blocked.mT, float("-inf")))
        return s
    s = torch.bmm(q_rows, k_cols.transpose(1, 2), out=out)
    if chunk.mask_row.numel():
        tiles = s.view(s.shape[0], block, -1, block)
        picked = tiles[chunk.mask_row, :, chunk.mask_slot, :]
        tiles[chunk.mask_row, :, chunk.mask_slot, :] = picked.masked_fill_(chunk.blocked, float("-inf"))
    return s


def _gather(blocks: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """[H * (nB + 1), B, D] blocks at slots [R, n] -> [R, n * B, D] (index_select: a plain block copy,
    several times faster than advanced indexing here)."""
    torch.index_select(blocks, 0, slots.flatten(), out=out.view(-1, *blocks.shape[1:]))
    return out


def _run_chunks(chunks: list[_Chunk], work, threads: int) -> list:
    """Calls ``work(chunk, state)`` on every chunk; returns the per-worker states (``state`` is a dict each
    worker owns). With ``threads`` > 1 the chunks are pulled by that many Python threads, each running
    single-threaded ops (ops release the GIL, so the Python overhead of one overlaps the other's compute)."""
    counter = itertools.count()

    def loop() -> dict:
        torch.set_num_threads(1)
        state: dict = {}
        for i in iter(lambda: next(counter), None):
            if i >= len(chunks):
                break
            work(chunks[i], state)
        return state

    workers = min(threads, len(chunks))
    if workers <= 1:
        return [loop()]
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(loop) for _ in range(workers)]
        return [f.result() for f in futures]


def _token_output(layout: TileLayout, plan: _Plan, like: torch.Tensor) -> torch.Tensor:
    """[nB, B, Hq, D] in ``like``'s dtype for the chunks to fill with ``_put_rows`` (zeros only where some
    row has no kept tile): written straight in token layout, without reordering and un-blocking passes."""
    nb, heads = layout.num_blocks, layout.num_q_heads
    make = torch.empty if plan.num_rows == heads * nb else torch.zeros
    return make(nb, layout.block_size, heads, like.shape[-1], dtype=like.dtype, device=like.device)


def _put_rows(x: torch.Tensor, chunk: _Chunk, rows: torch.Tensor) -> None:
    """A chunk's rows [R, B, D] into their places of ``_token_output``."""
    x.permute(2, 0, 1, 3)[chunk.head, chunk.block] = rows.to(x.dtype)


def _tokens(x: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """``_token_output`` [nB, B, H, D] -> [T, H, D]."""
    return x.view(-1, *x.shape[2:])[: layout.num_tokens]


def _kv_blocks(k: torch.Tensor, v: torch.Tensor, layout: TileLayout, dtype: torch.dtype, scale: float):
    """K (times the softmax scale, cheaper than scaling the Hq / Hkv times larger q) and V as blocks with
    the dummy block. With K scaled, dS @ K is dQ itself and only dK needs the scale afterwards."""
    return _to_blocks(k, layout, dtype, extra_block=True).mul_(scale), _to_blocks(v, layout, dtype, extra_block=True)


def lse_like(q: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """An empty log-sum-exp of ``forward``'s shape and dtype."""
    return q.new_empty(q.shape[1] * num_blocks, block_size, dtype=_compute_dtype(q.dtype))


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TileLayout, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the output [T, Hq, D] in q's dtype and the log-sum-exp [Hq * nB, B] (fp32 or fp64; -inf on
    rows with nothing allowed, whose output is 0)."""
    with single_threaded() as threads:
        return _forward(q, k, v, layout, scale, _workers(q.device, threads))


def _forward(q, k, v, layout: TileLayout, scale: float, threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    dtype, block, head_dim = _compute_dtype(q.dtype), layout.block_size, q.shape[-1]
    plan = _plan(layout)
    q_blocks = _to_blocks(q, layout, dtype)
    k_blocks, v_blocks = _kv_blocks(k, v, layout, dtype, scale)
    out = _token_output(layout, plan, q)
    lse = q_blocks.new_full((layout.num_q_heads * layout.num_blocks, block), float("-inf"))

    def work(chunk: _Chunk, state: dict) -> None:
        ws = state.setdefault("ws", _Workspace())
        rows, width = chunk.kv_slots.shape
        cols = (rows, width * block, head_dim)
        q_rows = torch.index_select(q_blocks, 0, chunk.rows, out=ws.get("q", (rows, block, head_dim), q_blocks))
        k_cols = _gather(k_blocks, chunk.kv_slots, ws.get("k", cols, q_blocks))
        s = _scores(chunk, q_rows, k_cols, ws.get("s", (rows, block, width * block), q_blocks), key_major=False)
        # exp(s - max) unnormalised and the output divided by its row sums afterwards: four light passes over
        # the scores, which also give the lse (max + log sum). A token with no allowed key has max -inf,
        # clamped so that its row is exp(-inf) = 0, its sum 0, its lse -inf and its output 0.
        row_max = s.amax(dim=-1, keepdim=True).clamp_min_(torch.finfo(s.dtype).min)
        p = s.sub_(row_max).exp_()
        row_sum = p.sum(dim=-1, keepdim=True)
        lse.index_copy_(0, chunk.rows, row_sum.log().add_(row_max).squeeze(-1))
        v_cols = _gather(v_blocks, chunk.kv_slots, k_cols)
        o_rows = torch.bmm(p, v_cols, out=ws.get("o", (rows, block, head_dim), q_blocks))
        _put_rows(out, chunk, o_rows.div_(row_sum.clamp_min_(torch.finfo(s.dtype).tiny)))

    _run_chunks(plan.chunks, work, threads)
    return _tokens(out, layout), lse


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
    """Gradients of q, k, v from the saved output and lse, visiting the kept tiles only.

    Scores are key-major here, [R, n * B, B]: the dK and dV partials then come tile by tile from plain
    matmuls (P^T dO and dS^T Q with a transposed [n * B, B] operand run at half MKL's speed); the forward keeps
    query-major scores (key-major ones are no faster there)."""
    with single_threaded() as threads:
        return _backward(q, k, v, out, lse, grad_out, layout, scale, _workers(q.device, threads))


def _workers(device: torch.device, threads: int) -> int:
    """Chunk workers: one per torch CPU thread on the CPU, one on a device, whose ops the host only queues (and a
    new thread would queue them on the device's default stream, not on the caller's)."""
    return threads if device.type == "cpu" else 1


def _blocked_lse(lse: torch.Tensor, layout: TileLayout, dtype: torch.dtype) -> torch.Tensor:
    """Any backend's lse (``lse.reshape(Hq, -1)[:, :T]`` is [Hq, T]) as [Hq * nB, B] in ``dtype``, with +inf
    wherever it is -inf (no allowed key) and in the padded tail: exp(s - lse) is then 0 there, never NaN."""
    lse = lse.reshape(layout.num_q_heads, -1)[:, : layout.num_tokens].to(dtype)
    lse = torch.where(lse.isneginf(), float("inf"), lse)
    padding = layout.num_blocks * layout.block_size - layout.num_tokens
    return torch.nn.functional.pad(lse, (0, padding), value=float("inf")).reshape(-1, layout.block_size)


def _backward(q, k, v, out, lse, grad_out, layout: TileLayout, scale: float, threads: int):
    dtype, block, head_dim = _compute_dtype(q.dtype), layout.block_size, q.shape[-1]
    plan = _plan(layout)
    q_blocks, do_blocks = _to_blocks(q, layout, dtype), _to_blocks(grad_out, layout, dtype)
    delta = _to_blocks((out.to(dtype) * grad_out.to(dtype)).sum(dim=-1, keepdim=True), layout, dtype).mT
    k_blocks, v_blocks = _kv_blocks(k, v, layout, dtype, scale)
    lse = _blocked_lse(lse, layout, dtype)
    dq = _token_output(layout, plan, q)

    def work(chunk: _Chunk, state: dict) -> None:
        if not state:
            state["dk"], state["dv"] = torch.zeros_like(k_blocks), torch.zeros_like(v_blocks)
            state["ws"] = _Workspace()
        ws = state["ws"]
        rows, width = chunk.kv_slots.shape
        cols, scores, own = (rows, width * block, head_dim), (rows, width * block, block), (rows, block, head_dim)
        qr = torch.index_select(q_blocks, 0, chunk.rows, out=ws.get("q", own, q_blocks))
        dor = torch.index_select(do_blocks, 0, chunk.rows, out=ws.get("do", own, q_blocks))
        k_cols = _gather(k_blocks, chunk.kv_slots, ws.get("k", cols, q_blocks))
        v_cols = _gather(v_blocks, chunk.kv_slots, ws.get("v", cols, q_blocks))
        s = _scores(chunk, qr, k_cols, ws.get("s", scores, q_blocks), key_major=True)
        p = s.sub_(lse.index_select(0, chunk.rows)[:, None, :]).exp_()
        slots = chunk.kv_slots.flatten()
        part = ws.get("part", cols, q_blocks)
        state["dv"].index_add_(0, slots, torch.bmm(p, dor, out=part).view(-1, block, head_dim))
        ds = torch.bmm(v_cols, dor.mT, out=ws.get("ds", scores, q_blocks))
        ds.sub_(delta.index_select(0, chunk.rows)).mul_(p)
        _put_rows(dq, chunk, torch.bmm(ds.mT, k_cols, out=ws.get("dq", own, q_blocks)))
        state["dk"].index_add_(0, slots, torch.bmm(ds, qr, out=part).view(-1, block, head_dim))

    states = _run_chunks(plan.chunks, work, threads)
    dk, dv = torch.zeros_like(k_blocks), torch.zeros_like(v_blocks)
    for state in states:
        if state:
            dk += state["dk"]
            dv += state["dv"]
    return (
        _tokens(dq, layout),
        _unblock(dk.mul_(scale), layout, layout.num_kv_heads, k.dtype),
        _unblock(dv, layout, layout.num_kv_heads, v.dtype),
    )
