"""Block geometry of a packed variable-length stream, shared by selection, attention backends and reference.

Blocks are ``block_size`` consecutive tokens of the packed stream; a block may hold tokens of several
documents. A tile (query block, key block) is a *candidate* when it can hold at least one allowed pair
(same document, key not after query): key block <= query block and the two blocks share a document.
Because documents are contiguous, sharing a document reduces to ``first_doc[qb] <= last_doc[kb]``.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, NamedTuple

import torch
import torch.nn.functional as F

from .launches import host_readable


@contextmanager
def single_threaded():
    """Runs torch's CPU ops single-threaded inside (yielding the previous thread count, restored on exit).
    Small ops gain nothing from OpenMP and lose a great deal when another process holds a core: every
    parallel region then waits for a descheduled thread (building a layout and the torch backend's plan took
    20x longer so on a shared machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield previous
    finally:
        torch.set_num_threads(previous)


def single_threaded_on_cpu(device: torch.device):
    """``single_threaded`` for work on the CPU; nothing for a device's (its ops use no host threads), nor while
    torch.compile traces (a thread count is no part of its graph)."""
    return single_threaded() if device.type == "cpu" and not torch.compiler.is_compiling() else nullcontext()


def check_power_of_two(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a positive power of two, got {value!r}")


def check_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> None:
    """cu_seqlens: int32 [docs + 1], non-decreasing, from 0 to ``num_tokens``.

    The offsets themselves are checked only on the CPU: reading them from a device would stall it on every
    call. Offsets on a device are trusted; a packed batch's are cumulative document lengths, valid by
    construction (``datamodules.packing.collate_packed``).
    """
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError("cu_seqlens must be a 1-D int32 tensor [docs + 1]")
    if cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must hold at least two offsets (one document)")
    if not host_readable(cu_seqlens):
        return
    if cu_seqlens[0] != 0 or cu_seqlens[-1] != num_tokens or bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(
            f"cu_seqlens must be non-decreasing from 0 to T={num_tokens}, got {cu_seqlens.tolist()[:8]}"
            f"{'...' if cu_seqlens.numel() > 8 else ''}"
        )


def check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    """q [T, Hq, D] and k [T, Hkv, D] with Hq a multiple of Hkv."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [T, H, D], got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on T and D")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if q.device != k.device:
        raise ValueError(f"q and k must be on one device, got {q.device} and {k.device}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q [T, Hq, D], k and v [T, Hkv, D] of one floating dtype on one device."""
    check_qk(q, k)
    if v.shape != k.shape or v.device != k.device:
        raise ValueError(f"v {tuple(v.shape)} must match k {tuple(k.shape)} in shape and device")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def check_block_mask(
    block_mask: torch.Tensor, num_q_heads: int, num_tokens: int, block_size: int, device, rows_of: int = 1
) -> None:
    """block_mask: bool [Hq, ceil(T/B), ceil(T/B)] on ``device``; with ``rows_of`` = W, one rank's striped rows
    of it, [Hq, T/(B W), T/B]."""
    nb = num_blocks(num_tokens, block_size)
    if block_mask.dtype != torch.bool or tuple(block_mask.shape) != (num_q_heads, nb // rows_of, nb):
        raise ValueError(
            f"block_mask must be bool [Hq, ceil(T/B), ceil(T/B)] = [{num_q_heads}, {nb}, {nb}] (or a rank's striped "
            f"rows of it, [{num_q_heads}, {nb // rows_of}, {nb}]), got {block_mask.dtype} {tuple(block_mask.shape)}"
        )
    if block_mask.device != device:
        raise ValueError(f"block_mask is on {block_mask.device}, q on {device}")


def check_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: torch.Tensor, block_size: int
) -> None:
    """The argument contract of ``block_sparse_attention`` besides the document bounds (``check_cu_seqlens``)."""
    check_power_of_two("block_size", block_size)
    check_qkv(q, k, v)
    check_block_mask(block_mask, q.shape[1], q.shape[0], block_size, q.device)


def num_blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def next_power_of_two(n: int) -> int:
    """The least power of two >= n (n >= 1), in plain Python: Triton's ``next_power_of_2`` is a constexpr function
    whose wrapper costs the host more than this on every launch."""
    return 1 << (n - 1).bit_length()


def token_doc_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Document index of every token, int32 [T] (as the Triton kernels read it): how many documents end at or before
    it (empty documents own no token). Fixed shapes, nothing read back from the device."""
    positions = torch.arange(num_tokens, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:], positions, right=True, out_int32=True)


def group_doc_range(doc: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last document of each group of ``group`` tokens (the last group may be partial)."""
    first, last = doc[::group], doc[group - 1 :: group]
    if doc.numel() % group:
        last = torch.cat([last, doc[-1:]])
    return first, last


def candidate_tiles(doc: torch.Tensor, block_size: int) -> torch.Tensor:
    """bool [nB, nB]: tiles that can hold an allowed pair (causal and sharing a document)."""
    first, last = group_doc_range(doc, block_size)
    n = first.numel()
    causal = torch.ones(n, n, dtype=torch.bool, device=doc.device).tril_()
    return causal & (first[:, None] <= last[None, :])


class PackedDocuments:
    """The documents of one packed stream of ``num_tokens`` tokens, bounded by ``cu_seqlens``, with what every
    layer's selection and attention derive from them in blocks of ``block_size``, each derived at its first use:
    each token's document (``doc``) and the candidate tiles. Made once per micro-batch and passed to each of its
    layers in place of ``cu_seqlens``, it spares every layer the launches that would derive them again, and checks
    the bounds once. Only the length and block size of a stream it is given with are checked: a new micro-batch
    needs a new one."""

    def __init__(self, cu_seqlens: torch.Tensor, num_tokens: int, block_size: int) -> None:
        check_cu_seqlens(cu_seqlens, num_tokens)
        check_power_of_two("block_size", block_size)
        self.cu_seqlens, self.num_tokens, self.block_size = cu_seqlens, num_tokens, block_size
        self._doc: torch.Tensor | None = None
        self._candidates: torch.Tensor | None = None
        self._derived: dict = {}

    @property
    def doc(self) -> torch.Tensor:
        """int32 [T]: ``token_doc_ids``."""
        if self._doc is None:
            self._doc = token_doc_ids(self.cu_seqlens, self.num_tokens)
        return self._doc

    @property
    def candidates(self) -> torch.Tensor:
        """bool [nB, nB]: ``candidate_tiles``."""
        if self._candidates is None:
            self._candidates = candidate_tiles(self.doc, self.block_size)
        return self._candidates

    def derived(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``, called at the first ask for ``key``: what another module derives from the documents alone
        (the ring's sink blocks, ``doc`` on its device), made once for all the stream's layers like ``doc`` and
        ``candidates``."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]


def as_packed_documents(
    bounds: torch.Tensor | PackedDocuments, num_tokens: int, block_size: int
) -> PackedDocuments:
    """A stream's document ``bounds`` (``cu_seqlens``, or its ``PackedDocuments``) as ``PackedDocuments`` of
    ``num_tokens`` tokens in blocks of ``block_size``."""
    if not isinstance(bounds, PackedDocuments):
        return PackedDocuments(bounds, num_tokens, block_size)
    if (bounds.num_tokens, bounds.block_size) != (num_tokens, block_size):
        raise ValueError(f"the packed documents are of {bounds.num_tokens} tokens in blocks of {bounds.block_size}, "
                         f"the call's of {num_tokens} in blocks of {block_size}: make one per stream and block size")
    return bounds


def striped_blocks(num_blocks: int, world_size: int, rank: int, device=None) -> torch.Tensor:
    """The blocks a rank holds in the block-striped layout of context parallelism: rank, rank + W, ..."""
    return torch.arange(rank, num_blocks, world_size, device=device)


def check_window(sink_blocks: int, local_blocks: int) -> None:
    """The always-kept window's sizes: at least the diagonal, and no negative count of sink blocks."""
    if local_blocks < 1 or sink_blocks < 0:
        raise ValueError(f"local_blocks must be >= 1 and sink_blocks >= 0, got {local_blocks} and {sink_blocks}")


def forced_tiles(
    doc: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int, sink_blocks: int = 1, local_blocks: int = 1
) -> torch.Tensor:
    """bool [nB, nB]: the always-kept tiles: the ``local_blocks`` blocks ending at the diagonal (a local window,
    1: the diagonal alone) and the first ``sink_blocks`` blocks of the query block's first document (0: none).
    Tiles outside the causal document ranges are dropped by the caller (``& candidate_tiles``).

    Any document other than the first one of a query block starts inside that block, so its first block is
    the diagonal; only the first document's first blocks need adding.
    """
    check_window(sink_blocks, local_blocks)
    first, _ = group_doc_range(doc, block_size)
    blocks = torch.arange(first.numel(), device=doc.device)
    behind = blocks[:, None] - blocks[None, :]
    past_sink = blocks[None, :] - cu_seqlens.long()[first][:, None] // block_size
    window = behind < local_blocks
    sink = (past_sink >= 0) & (past_sink < sink_blocks)
    return (behind >= 0) & (window | sink)


def pair_mask(
    doc: torch.Tensor,
    rows: torch.Tensor,
    block_size: int,
    block_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact token-level mask for query tokens ``rows``: [R, T] causal and same document, further
    restricted by ``block_mask`` [H, nB, nB] to [H, R, T] when given (the semantics of ``block_sparse_attention``)."""
    cols = torch.arange(doc.numel(), device=doc.device)
    allowed = (doc[rows, None] == doc[None, :]) & (cols[None, :] <= rows[:, None])
    if block_mask is None:
        return allowed
    kept = block_mask[:, rows // block_size][:, :, cols // block_size]
    return allowed & kept


class TileRows(NamedTuple):
    """The kept tiles of a layout as compressed rows, ``r = h * nB + qb`` over query heads and query blocks:
    ``tile_col`` lists each row's kept key blocks in increasing order, ``row_ptr`` where each row starts, and
    ``tile_partial`` which tiles need token-level masking. Its length is data: building it reads the device."""

    row_ptr: torch.Tensor  # int64 [Hq * nB + 1]
    tile_row: torch.Tensor  # int64 [P]
    tile_col: torch.Tensor  # int64 [P]
    tile_partial: torch.Tensor  # bool [P]


class TileLists(NamedTuple):
    """The kept tiles of a layout in fixed shapes, as FlexAttention's ``BlockMask`` holds them: for every row
    (query head, block) its number of kept blocks and their indices in increasing order, the rest of the row
    undefined. The lists of key blocks per query block drive the forward, the transposed ones (query blocks per
    key block) the key and value gradients. Built without reading anything back from the device."""

    count: torch.Tensor  # int32 [Hq, nB]
    index: torch.Tensor  # int32 [Hq, nB, nB]


@dataclass(frozen=True)
class TileLayout:
    """The kept tiles of one attention call over a stream of blocks, plus the token document ids.

    ``kept`` [Hq, nB, nB] marks the tiles with work: kept by the block mask, causal, and sharing a document;
    tiles that hold no allowed pair are dropped, so every backend visits only tiles with work. A layout holds
    them as ``tiles`` [Hq, nQ, nK], its query blocks (the stream's last nQ) against its key blocks (the first
    nK): the stream of a ring step with another rank's keys is those keys then the rank's queries, and its layout,
    kept from the ring's forward until its backward, holds a quarter of ``kept``, derived where a backend asks.
    ``partial()`` [nB, nB] marks the tiles that need token-level masking (diagonal, or a block touching more than
    one document); kept tiles outside it are fully allowed. Both are fixed-shape masks, so a layout is built
    without host synchronisation; each backend derives the form it walks: ``lists`` (Triton and flex, fixed
    shapes) or ``rows`` (the torch backend, compressed, sized by the data). Backends keep what they derive in
    ``scratch`` so the backward reuses the forward's work.
    """

    num_tokens: int
    block_size: int
    num_blocks: int
    num_q_heads: int
    num_kv_heads: int
    doc: torch.Tensor  # int32 [T]
    tiles: torch.Tensor  # bool [Hq, nQ, nK] (expanded over the heads, stride 0, for a ring without a block mask)
    scratch: dict = field(default_factory=dict, compare=False, repr=False)  # per-backend derived data

    @staticmethod
    def build(
        block_mask: torch.Tensor, cu_seqlens: torch.Tensor | PackedDocuments, num_tokens: int, num_kv_heads: int,
        block_size: int,
    ) -> "TileLayout":
        """The layout of ``block_sparse_attention`` over a whole stream of ``num_tokens`` tokens."""
        documents = as_packed_documents(cu_seqlens, num_tokens, block_size)
        with single_threaded_on_cpu(block_mask.device):
            kept = block_mask & documents.candidates
            return TileLayout._from_tiles(kept, documents.doc, num_kv_heads, block_size)

    @staticmethod
    @single_threaded()
    def build_ring_step(
        block_mask: torch.Tensor | None,
        doc: torch.Tensor,
        num_q_heads: int,
        num_kv_heads: int,
        block_size: int,
        *,
        world_size: int,
        rank: int,
        source: int,
        sinks: torch.Tensor | None = None,
    ) -> "TileLayout":
        """One step of block-striped ring attention: ``rank``'s query blocks (global blocks rank, rank + W, ...)
        against ``source``'s key blocks, with causality, documents (``doc``, the global token document ids) and
        ``block_mask`` [Hq, nB, nB] (None: every causal block) in global coordinates, or only ``rank``'s rows of
        it [Hq, nB / W, nB]. ``sinks`` (bool [nB]): key blocks every rank holds a copy of, whose tiles below the
        diagonal the sink step computes instead (``build_sink_step``).

        The backends test causality on stream positions and documents with one ``doc`` array, so the layout's
        stream is the rank's own shard when source == rank (the diagonal blocks need token-level causality),
        and otherwise source's shard followed by the rank's, keys then queries: every kept key block then
        precedes its query block globally and in the stream. Callers place tensors in that stream.
        """
        nb = num_blocks(doc.numel(), block_size)
        q_blocks, k_blocks = (striped_blocks(nb, world_size, r, doc.device) for r in (rank, source))
        kept = _striped_tiles(block_mask, doc, block_size, q_blocks, k_blocks)
        if sinks is not None:
            kept = kept & ~(sinks[k_blocks][None, None, :] & (k_blocks[None, None, :] < q_blocks[None, :, None]))
        blocked = doc.view(nb, block_size)
        q_doc, k_doc = blocked[q_blocks].flatten(), blocked[k_blocks].flatten()
        stream_doc = q_doc if source == rank else torch.cat([k_doc, q_doc])
        return TileLayout._from_tiles(kept.expand(num_q_heads, -1, -1), stream_doc, num_kv_heads, block_size)

    @staticmethod
    @single_threaded()
    def build_sink_step(
        block_mask: torch.Tensor | None,
        doc: torch.Tensor,
        num_q_heads: int,
        num_kv_heads: int,
        block_size: int,
        *,
        world_size: int,
        rank: int,
        sink_indices: torch.Tensor,
    ) -> "TileLayout":
        """``rank``'s query blocks against the sink key blocks (``sink_indices``, int64, increasing) strictly below
        them, of which every rank holds a copy: the tiles ``build_ring_step`` leaves out with the same sinks. The
        stream is the sink blocks in order, then the rank's shard."""
        nb = num_blocks(doc.numel(), block_size)
        q_blocks, k_blocks = striped_blocks(nb, world_size, rank, doc.device), sink_indices
        kept = _striped_tiles(block_mask, doc, block_size, q_blocks, k_blocks)
        kept = kept & (k_blocks[None, None, :] < q_blocks[None, :, None])
        blocked = doc.view(nb, block_size)
        stream_doc = torch.cat([blocked[k_blocks].flatten(), blocked[q_blocks].flatten()])
        return TileLayout._from_tiles(kept.expand(num_q_heads, -1, -1), stream_doc, num_kv_heads, block_size)

    @staticmethod
    def _from_tiles(tiles: torch.Tensor, stream_doc: torch.Tensor, num_kv_heads: int, block_size: int) -> "TileLayout":
        """The layout of ``tiles`` [Hq, nQ, nK] (causal tiles within documents only) in a stream with documents
        ``stream_doc`` whose last nQ blocks are the query blocks and whose first nK blocks are the key blocks (the
        same blocks when the stream is the whole one)."""
        nb = num_blocks(stream_doc.numel(), block_size)
        return TileLayout(stream_doc.numel(), block_size, nb, tiles.shape[0], num_kv_heads, stream_doc, tiles)

    @property
    def kept(self) -> torch.Tensor:
        """bool [Hq, nB, nB]: ``tiles`` placed in the stream (kept in ``scratch`` where that takes a copy)."""
        n_q, n_k, nb = *self.tiles.shape[1:], self.num_blocks
        if n_q == n_k == nb:
            return self.tiles
        if "kept" not in self.scratch:
            self.scratch["kept"] = F.pad(self.tiles, (0, nb - n_k, nb - n_q, 0))
        return self.scratch["kept"]

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def partial(self) -> torch.Tensor:
        """bool [nB, nB]: the tiles that need token-level masking, the diagonal and those whose blocks do not lie
        in one document; computed where a backend asks (the torch and flex ones). In a ring step's stream
        (keys, then queries) the same test on the stream's documents gives the global tiles' answer."""
        if "partial" not in self.scratch:
            first, last = group_doc_range(self.doc, self.block_size)
            blocks = torch.arange(self.num_blocks, device=self.doc.device)
            self.scratch["partial"] = (blocks[:, None] == blocks[None, :]) | (first[None, :] != last[:, None])
        return self.scratch["partial"]

    def rows(self) -> TileRows:
        """The kept tiles as compressed rows (``TileRows``); reads the tile count back from the device."""
        if "rows" not in self.scratch:
            head, qb, kb = self.kept.nonzero(as_tuple=True)
            row = head * self.num_blocks + qb
            counts = self.kept.sum(-1).flatten()
            row_ptr = torch.zeros(counts.numel() + 1, dtype=torch.long, device=row.device)
            torch.cumsum(counts, 0, out=row_ptr[1:])
            self.scratch["rows"] = TileRows(row_ptr, row, kb, self.partial()[qb, kb])
        return self.scratch["rows"]

    def release(self) -> None:
        """Drops what backends derived (``scratch``), which a backend derives again where it needs it: a layout kept
        from a forward until its backward then holds its tiles only."""
        self.scratch.clear()

    def lists(self, transposed: bool = False) -> TileLists:
        """Kept key blocks per query block, or with ``transposed`` kept query blocks per key block (``TileLists``)."""
        key = "lists_t" if transposed else "lists"
        if key not in self.scratch:
            self.scratch[key] = tile_lists(self.kept, transposed)
        return self.scratch[key]


def tile_lists(tiles: torch.Tensor, transposed: bool = False) -> TileLists:
    """The ``TileLists`` of bool ``tiles`` [H, nB, nB] by row, or with ``transposed`` by column."""
    tiles = tiles.transpose(1, 2) if transposed else tiles
    index = torch.argsort(tiles, dim=-1, descending=True, stable=True)
    index = index.to(torch.int32, memory_format=torch.contiguous_format)  # sorting a transpose keeps its strides
    return TileLists(tiles.sum(-1, dtype=torch.int32), index)


def _striped_tiles(
    block_mask: torch.Tensor | None, doc: torch.Tensor, block_size: int, q_blocks: torch.Tensor, k_blocks: torch.Tensor
) -> torch.Tensor:
    """bool [1 or Hq, nQ, nK]: the tiles of global query blocks ``q_blocks`` against key blocks ``k_blocks`` that
    are causal, share a document and are kept by ``block_mask`` (global [Hq, nB, nB], or only the query blocks'
    rows [Hq, nQ, nB]; None: all)."""
    first, last = group_doc_range(doc, block_size)
    kept = (k_blocks[None, :] <= q_blocks[:, None]) & (first[q_blocks][:, None] <= last[k_blocks][None, :])
    kept = kept[None]
    if block_mask is not None:
        rows = block_mask if block_mask.shape[1] == q_blocks.numel() else block_mask[:, q_blocks]
        kept = kept & rows[:, :, k_blocks]
    return kept
