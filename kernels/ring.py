"""Context parallelism: block-sparse attention over one packed stream shared by a group of W ranks.

Layout (MTraining's balanced sparse ring attention): block-striped, rank r holds global blocks r, r + W,
r + 2W, ... of B tokens, so every rank's rows and every ring step's columns are a stride-W sample of the
global mask, and local windows, sinks and vertical stripes spread evenly over ranks and steps.

At ring step t a rank attends its queries to the K/V of source (r - t) mod W with one call of an existing
backend on the step's tile layout (``TileLayout.build_ring_step``: causality, documents and the selected
block mask in global coordinates), and merges the step's output into a running fp32 result through the
natural-log log-sum-exp. K/V travel one rank forward per step; every rank posts the same sends and
receives at every step whatever its tiles, so a step with nothing kept skips compute, never communication.

Sinks: every query block of a document attends the document's first block (the selection always keeps it),
and that block lives on one rank, so at every ring step the one rank visiting a sink's holder would compute
far more tiles than the others (max / mean per step 1.6-1.8 at W = 8 on real masks). The first block of each
document longer than W blocks is therefore summed onto every rank once per call (``sink_blocks``: zeros but
the owner's rows, one all-reduce), and each rank computes its queries' tiles against the sinks in a sink step
before the ring, whose steps leave those tiles out; their dK/dV partials are summed back to the owners after
the ring.

Backward: each step's tiles are recomputed against the merged output. The backends' backward takes the
lse of their own forward on the layout, and uses ``out`` only through rowsum(out * grad_out): given the
step's lse, the merged output and grad_out scaled per row by exp(lse_step - lse), the share of the merged
softmax this step holds, it returns exactly this step's part of the merged gradients. dQ accumulates
locally; fp32 dK/dV partials travel the ring one step behind K/V and reach their owner after W steps.
Only the rank's own K/V are saved for the backward, which sends them round again; besides q, k, v and the
merged output and lse, a rank saves one lse [Hq, T/W] per ring step.

A hierarchical ring (``node_size``) nests the same schedule: an inner ring within each node, and between
inner rings the K/V (forward) and the node's summed dK/dV partials (backward) move one node on, their
transfers overlapping a whole inner ring. A flat ring is one node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .attention import _implementation, resolve_backend
from .layout import (
    PackedDocuments,
    TileLayout,
    as_packed_documents,
    check_block_mask,
    check_power_of_two,
    check_qkv,
    striped_blocks,
)

# Tags keep apart the messages that share a link: K/V and travelling dK/dV, on the inner and outer rings.
_KV_TAG, _GRAD_TAG, _OUTER_KV_TAG, _OUTER_GRAD_TAG = 0, 1, 2, 3
_WAIT_KEY = ("ring wait", 0)  # waits never overlap: one key serves all


def context_shard(x: torch.Tensor, *, world_size: int, rank: int, block_size: int) -> torch.Tensor:
    """This rank's rows of the packed stream ``x`` (tokens on dim 0) in the block-striped layout: blocks
    rank, rank + W, ... of ``block_size`` tokens, [T / W, ...]."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if x.shape[0] % (world_size * block_size):
        raise ValueError(
            f"x has {x.shape[0]} tokens, not a multiple of world_size * block_size = {world_size * block_size}: "
            "pad the stream with a padding document first"
        )
    nb = x.shape[0] // block_size
    blocks = x.reshape(nb, block_size, *x.shape[1:])
    return blocks[striped_blocks(nb, world_size, rank, x.device)].reshape(-1, *x.shape[1:])


def context_unshard(shards: Sequence[torch.Tensor], *, block_size: int) -> torch.Tensor:
    """The packed stream from every rank's ``context_shard`` rows, in rank order (inverse of the striping)."""
    if len(shards) == 0:
        raise ValueError("shards must hold one tensor per rank, got none")
    shape = shards[0].shape
    if any(s.shape != shape for s in shards):
        raise ValueError(f"shards must share one shape, got {[tuple(s.shape) for s in shards]}")
    if not isinstance(block_size, int) or block_size < 1 or shape[0] % block_size:
        raise ValueError(f"block_size must be a positive int dividing the shard length {shape[0]}, got {block_size!r}")
    blocks = [s.reshape(shape[0] // block_size, block_size, *shape[1:]) for s in shards]
    return torch.stack(blocks, dim=1).reshape(-1, *shape[1:])


class WaitTimer(Protocol):
    """Times the waits on ring transfers (``sparsebalance_pl.timing.AttentionTimer`` is one): ``start`` and
    ``stop`` bracket each wait; on CUDA they must record events on the stream that the wait blocks."""

    def start(self, key: tuple[str, int]) -> None: ...

    def stop(self, key: tuple[str, int]) -> None: ...


@dataclass
class _Ring:
    """The group, this rank's place in it as (node, local rank) with ``node_size`` neighbouring ranks per
    node, and one tile layout per step in schedule order: outer step o over nodes, inner step i within the
    node, K/V of rank ((node - o) mod N) * L + (local - i) mod L. A flat ring is one node of W ranks."""

    group: dist.ProcessGroup | None
    world_size: int
    rank: int
    node_size: int
    layouts: list[TileLayout]
    label: str = ""
    wait_timer: WaitTimer | None = None
    sinks: _Sinks | None = None  # key blocks every rank holds a copy of (see ``sink_blocks``)
    sink_layout: TileLayout | None = None  # this rank's tiles against them
    # Whether each step (``layouts``, then the sink step) keeps any tile, read from the device once per call: a
    # step without tiles skips its compute
    step_has_tiles: list[bool] = field(default_factory=list)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.node_size

    def source(self, outer: int, inner: int) -> int:
        node, local = divmod(self.rank, self.node_size)
        return (node - outer) % self.num_nodes * self.node_size + (local - inner) % self.node_size

    def link(self, outer: bool) -> tuple[int, int]:
        """(next, previous) rank on the inner ring (within the node) or the outer one (same local rank)."""
        node, local = divmod(self.rank, self.node_size)
        if outer:
            return tuple((node + d) % self.num_nodes * self.node_size + local for d in (1, -1))
        return tuple(node * self.node_size + (local + d) % self.node_size for d in (1, -1))


class _Transfer:
    """A tensor on its way to the next rank of a link while the previous rank's arrives; on a link of one
    rank the tensor comes straight back. Holds the sent tensor until the transfer is done. The send and the receive
    are posted as one batch: NCCL would otherwise run them one after the other, each rank's send waiting for a
    receive its neighbour posts only after its own send, a ring that never moves once a message outgrows NCCL's
    buffers."""

    def __init__(self, ring: _Ring, tensor: torch.Tensor, tag: int, outer: bool = False) -> None:
        self.rank, self.sent, self.label, self.timer = ring.rank, tensor, ring.label, ring.wait_timer
        destination, self.source = ring.link(outer)
        if destination == ring.rank:
            self.received, self.requests = tensor, []
            return
        self.received = torch.empty_like(tensor)
        self.requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, group=ring.group, tag=tag, group_peer=destination),
            dist.P2POp(dist.irecv, self.received, group=ring.group, tag=tag, group_peer=self.source),
        ])

    def wait(self, step: int, what: str) -> torch.Tensor:
        if self.timer is not None and self.requests:
            self.timer.start(_WAIT_KEY)
        try:
            for request in self.requests:
                request.wait()
        except RuntimeError as err:
            raise RuntimeError(
                f"ring attention{self.label}: rank {self.rank} got no {what} from rank {self.source} at ring step "
                f"{step}: {err}"
            ) from err
        if self.timer is not None and self.requests:
            self.timer.stop(_WAIT_KEY)
        return self.received


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_queries(x: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Rows of this rank's queries placed in a step's stream, where they are the last tokens."""
    pad = layout.num_tokens - x.shape[0]
    return torch.cat([x.new_zeros(pad, *x.shape[1:]), x]) if pad else x


def _as_keys(x: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Rows of the visiting keys placed in a step's stream, where they are the first tokens."""
    pad = layout.num_tokens - x.shape[0]
    return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x


def _query_lse(lse: torch.Tensor, layout: TileLayout, num_local: int) -> torch.Tensor:
    """A backend's lse of a step's stream -> [Hq, T/W] of this rank's queries."""
    return lse.reshape(layout.num_q_heads, -1)[:, layout.num_tokens - num_local : layout.num_tokens]


def _merge(out: torch.Tensor, lse: torch.Tensor, out_step: torch.Tensor, lse_step: torch.Tensor) -> None:
    """In place, out [T, Hq, D] and lse [Hq, T] absorb one step's partial attention. A row with no keys on
    either side (lse -inf) keeps out and lse, where exp(lse_step - merged) alone would give NaN."""
    merged = torch.logaddexp(lse, lse_step)
    weight = torch.where(torch.isneginf(merged), 0.0, torch.exp(lse_step - merged))
    out.add_(weight.t().unsqueeze(-1) * (out_step.to(out.dtype) - out))
    lse.copy_(merged)


def _forward(ring: _Ring, impl, q, k, v, scale):
    """Returns the merged output in q's dtype, the merged lse [Hq, T/W], each ring step's lse (None where the
    step kept no tile), the sink blocks' K/V (None without) and the sink step's lse (None without tiles)."""
    acc = _accumulation_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=q.device)
    step_lse = []
    sink_kv = sink_lse = None
    if ring.sink_layout is not None:
        sink_kv = _sink_rows(ring, torch.stack([k, v]), ring.sink_layout.block_size)
        sink_lse = _attend_step(impl, ring.sink_layout, ring.step_has_tiles[-1], q, sink_kv, scale, out, lse)
    outer_kv = torch.stack([k, v])  # one message per step
    steps = iter(enumerate(ring.layouts))
    for outer in range(ring.num_nodes):
        last_outer = outer == ring.num_nodes - 1
        if not last_outer:  # the next node's K/V arrive while the whole inner ring computes
            outer_transfer = _Transfer(ring, outer_kv, _OUTER_KV_TAG, outer=True)
        kv = outer_kv
        for inner in range(ring.node_size):
            step, layout = next(steps)
            last = inner == ring.node_size - 1
            if not last:
                transfer = _Transfer(ring, kv, _KV_TAG)
            step_lse.append(_attend_step(impl, layout, ring.step_has_tiles[step], q, kv, scale, out, lse))
            if not last:
                kv = transfer.wait(step, "K/V")
        if not last_outer:
            outer_kv = outer_transfer.wait(step, "K/V from the previous node")
    return out.to(q.dtype), lse, step_lse, sink_kv, sink_lse


def _attend_step(impl, layout, has_tiles: bool, q, kv, scale, out, lse):
    """One step's attention of this rank's queries to ``kv``, merged into ``out`` and ``lse`` in place; returns
    the step's lse [Hq, T/W] (None when the step keeps no tile)."""
    if not has_tiles:
        return None
    out_step, lse_step = impl.forward(_as_queries(q, layout), _as_keys(kv[0], layout), _as_keys(kv[1], layout),
                                      layout, scale)
    lse_step = _query_lse(lse_step, layout, q.shape[0]).contiguous()  # saved: not the stream's
    _merge(out, lse, out_step[layout.num_tokens - q.shape[0] :], lse_step)
    return lse_step


@dataclass(frozen=True)
class _Sinks:
    """A stream's sink blocks (``sink_blocks``) for one rank of its ring, found once per stream."""

    mask: torch.Tensor  # bool [nB]
    blocks: torch.Tensor  # int64 [S]: their global indices, increasing
    owned_slots: torch.Tensor  # int64 [S_r]: the places in ``blocks`` of the S_r sink blocks this rank holds
    owned_local_blocks: torch.Tensor  # int64 [S_r]: and their indices among this rank's blocks


def _find_sinks(documents: PackedDocuments, device: torch.device, world_size: int, rank: int) -> _Sinks | None:
    """This rank's ``_Sinks`` of the stream, None without any (host reads, made once per stream)."""
    mask = sink_blocks(documents.cu_seqlens.to(device), documents.num_tokens // documents.block_size,
                       documents.block_size, world_size)
    if mask is None:
        return None
    blocks = mask.nonzero()[:, 0]
    owned_slots = (blocks % world_size == rank).nonzero()[:, 0]
    return _Sinks(mask, blocks, owned_slots, blocks[owned_slots] // world_size)


def sink_blocks(cu_seqlens: torch.Tensor, num_blocks: int, block_size: int, world_size: int) -> torch.Tensor | None:
    """bool [nB]: the first block of every document spanning more than ``world_size`` blocks, or None when there
    is none. Every query block of such a document attends its first block (a sink the selection always keeps),
    and that block lives on one rank: in the ring only the rank visiting it at a step would compute those tiles,
    so every step would have one rank far busier than the others. Each rank gets a copy instead and computes
    them before the ring (the sink step), which leaves the ring's steps balanced."""
    if world_size == 1:
        return None
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    first, last = starts // block_size, (ends - 1) // block_size
    long_docs = (ends > starts) & (last - first >= world_size)
    if not bool(long_docs.any()):
        return None
    sinks = torch.zeros(num_blocks, dtype=torch.bool, device=cu_seqlens.device)
    sinks[first[long_docs]] = True
    return sinks


def _sink_rows(ring: _Ring, local: torch.Tensor, block_size: int) -> torch.Tensor:
    """The sink blocks' rows of ``local`` ([2, T/W, H, D]: this rank's K/V) gathered from their owners on every
    rank, [2, S * B, H, D] in block order: each owner writes its own blocks into zeros and one sum over the
    group gathers them."""
    rows = torch.zeros(local.shape[0], ring.sinks.blocks.numel(), block_size, *local.shape[2:], dtype=local.dtype,
                       device=local.device)
    rows[:, ring.sinks.owned_slots] = local.unflatten(1, (-1, block_size))[:, ring.sinks.owned_local_blocks]
    _group_sum(ring, rows, "before ring step 0")
    return rows.flatten(1, 2)


def _group_sum(ring: _Ring, x: torch.Tensor, when: str) -> None:
    """In place, ``x`` summed over the ring's group (a blocking collective: timed as a wait); ``when`` names the
    moment in an error."""
    if ring.wait_timer is not None:
        ring.wait_timer.start(_WAIT_KEY)
    try:
        dist.all_reduce(x, group=ring.group)
    except RuntimeError as err:
        raise RuntimeError(f"ring attention{ring.label}: rank {ring.rank} got no sink blocks from the group's ranks "
                           f"{when}: {err}") from err
    if ring.wait_timer is not None:
        ring.wait_timer.stop(_WAIT_KEY)


def _step_backward(impl, layout, q, kv, out, lse, lse_step, grad_out, scale):
    """One step's (dq [T/W, Hq, D], dk and dv of ``kv``'s rows stacked [2, rows, Hkv, D]) of the merged attention's
    gradients."""
    local = q.shape[0]
    share = torch.where(torch.isneginf(lse_step), 0.0, torch.exp(lse_step - lse))  # [Hq, T/W]
    grad_step = (grad_out * share.t().unsqueeze(-1)).to(grad_out.dtype)
    stream_lse = lse_step.new_full((layout.num_q_heads, layout.num_tokens), float("-inf"))
    stream_lse[:, layout.num_tokens - local :] = lse_step  # the backends' lse layout, queries last
    dq, dk, dv = impl.backward(
        _as_queries(q, layout), _as_keys(kv[0], layout), _as_keys(kv[1], layout), _as_queries(out, layout),
        stream_lse, _as_queries(grad_step, layout), layout, scale,
    )
    keys = kv.shape[1]
    return dq[layout.num_tokens - local :], torch.stack([dk[:keys], dv[:keys]])


def _backward(ring: _Ring, impl, q, k, v, out, lse, step_lse, sink_kv, sink_lse, grad_out, scale):
    acc = _accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    outer_kv = torch.stack([k, v])
    steps = iter(enumerate(zip(ring.layouts, step_lse)))
    grads: _Transfer | None = None  # the dK/dV partials in flight, within a node and across nodes; each is
    outer_grads: _Transfer | None = None  # sent before it is first waited on (inner > 0, outer > 0, the end)
    for outer in range(ring.num_nodes):
        last_outer = outer == ring.num_nodes - 1
        if not last_outer:
            outer_transfer = _Transfer(ring, outer_kv, _OUTER_KV_TAG, outer=True)
        kv = outer_kv
        for inner in range(ring.node_size):
            step, (layout, lse_step) = next(steps)
            last = inner == ring.node_size - 1
            if not last:
                transfer = _Transfer(ring, kv, _KV_TAG)
            partial = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            if lse_step is not None:
                dq_step, dkv_step = _step_backward(impl, layout, q, kv, out, lse, lse_step, grad_out, scale)
                dq += dq_step
                partial += dkv_step
            if inner:  # the partials of this K/V from the ranks of the node it visited before
                partial += grads.wait(step - 1, "dK/dV")
            grads = _Transfer(ring, partial, _GRAD_TAG)  # after the last inner step: to this outer K/V's holder
            if not last:
                kv = transfer.wait(step, "K/V")
        # This rank's outer K/V, summed over its node, joins the same K/V's sum over the nodes before and
        # travels on one node, behind the K/V; after the last outer step it reaches the owner.
        node_partial = grads.wait(step, "dK/dV")
        if outer:
            node_partial += outer_grads.wait(step, "dK/dV from the previous node")
        outer_grads = _Transfer(ring, node_partial, _OUTER_GRAD_TAG, outer=True)
        if not last_outer:
            outer_kv = outer_transfer.wait(step, "K/V from the previous node")
    dkv = outer_grads.wait(step, "dK/dV from the previous node")
    if sink_kv is not None:  # every rank's part of the sink blocks' gradients, summed, to the blocks' owners
        sink_grads = torch.zeros(sink_kv.shape, dtype=acc, device=q.device)
        if sink_lse is not None:
            dq_step, sink_grads = _step_backward(impl, ring.sink_layout, q, sink_kv, out, lse, sink_lse, grad_out,
                                                 scale)
            dq += dq_step
            sink_grads = sink_grads.to(acc)
        _group_sum(ring, sink_grads, f"after ring step {step} (their gradients)")
        block, sinks = ring.sink_layout.block_size, ring.sinks
        owned_grads = sink_grads.unflatten(1, (-1, block))[:, sinks.owned_slots]
        dkv.unflatten(1, (-1, block))[:, sinks.owned_local_blocks] += owned_grads
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, impl, scale):
        out, lse, step_lse, sink_kv, sink_lse = _forward(ring, impl, q, k, v, scale)
        if q.is_cuda:  # every layer keeps its ring's layouts until its backward: their block lists and padded tile
            # masks would fill the GPU
            for layout in ring.layouts if ring.sink_layout is None else [*ring.layouts, ring.sink_layout]:
                layout.release()
        optional = [sink_kv, sink_lse, *step_lse]
        ctx.save_for_backward(q, k, v, out, lse, *(x for x in optional if x is not None))
        ctx.ring, ctx.impl, ctx.scale = ring, impl, scale
        ctx.present = [x is not None for x in optional]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, *saved = ctx.saved_tensors
        saved = iter(saved)
        sink_kv, sink_lse, *step_lse = [next(saved) if present else None for present in ctx.present]
        dq, dk, dv = _backward(ctx.ring, ctx.impl, q, k, v, out, lse, step_lse, sink_kv, sink_lse,
                               grad_out.contiguous(), ctx.scale)
        return dq, dk, dv, None, None, None


def group_place(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(world size, rank) of the group; without a process group, a ring of one."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the context-parallel group it passed")
    return dist.get_world_size(group), rank


def sparse_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | PackedDocuments,
    *,
    block_size: int,
    group: dist.ProcessGroup | None = None,
    block_mask: torch.Tensor | None = None,
    backend: str = "auto",
    scale: float | None = None,
    node_size: int | None = None,
    label: str | None = None,
    wait_timer: WaitTimer | None = None,
) -> torch.Tensor:
    """``block_sparse_attention`` of a packed stream held block-striped by the ranks of ``group``.

    q [T/W, Hq, D], k and v [T/W, Hkv, D]: this rank's ``context_shard`` rows of a stream of T tokens (T a
    multiple of W * block_size); cu_seqlens: the stream's global int32 [docs + 1], or its ``PackedDocuments`` of T
    tokens (made once for all layers); block_mask: the global bool
    [Hq, T/B, T/B], or only this rank's rows of it, [Hq, T/(B W), T/B] in the rank's order (``mask[:,
    striped_blocks(T/B, W, rank)]``: W times less memory to keep for a recomputation), None for every causal
    block (dense ring attention from the same code). ``group``: the
    context-parallel process group (None: the default group, or a ring of one without a process group).
    Returns this rank's output rows [T/W, Hq, D], differentiable in q, k and v; gathered with
    ``context_unshard`` they equal ``block_sparse_attention`` on the whole stream. Every rank of the group
    must call it with the same cu_seqlens; of block_mask it reads only the rows of its own query blocks, so
    each rank may pass the mask ``select_blocks_striped`` gives it (the other ranks' rows False).

    ``node_size``: a hierarchical ring for groups spanning nodes, an inner ring over each node's
    ``node_size`` neighbouring group ranks and an outer ring over the nodes, each outer transfer hidden
    behind a whole inner ring of compute (the striping stays over the flat group). None: one flat ring.
    ``label`` names the call in the error of a transfer that fails or times out (e.g. ``"layer 3"``), beside
    the rank, the peer and the ring step. ``wait_timer`` times every wait on a transfer (the communication the
    compute did not hide, and waits on slower ranks), forward and backward.
    """
    world_size, rank = group_place(group)
    node_size = world_size if node_size is None else node_size
    if not isinstance(node_size, int) or node_size < 1 or world_size % node_size:
        raise ValueError(f"node_size must divide the group's {world_size} ranks into whole nodes, got {node_size!r}")
    check_power_of_two("block_size", block_size)
    check_qkv(q, k, v)
    if q.shape[0] % block_size:
        raise ValueError(
            f"q holds {q.shape[0]} tokens, not a multiple of block_size {block_size}: shard with context_shard "
            f"a stream padded to a multiple of world_size * block_size = {world_size * block_size}"
        )
    num_tokens = q.shape[0] * world_size
    documents = as_packed_documents(cu_seqlens, num_tokens, block_size)
    if block_mask is not None:
        rows_of = world_size if block_mask.shape[1:2] == (q.shape[0] // block_size,) else 1
        check_block_mask(block_mask, q.shape[1], num_tokens, block_size, q.device, rows_of=rows_of)
    resolved = resolve_backend(backend, q.device)
    if resolved == "flex":
        raise ValueError("ring attention runs on the torch or triton backend; flex attends whole streams only")
    impl = _implementation(resolved)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    doc = documents.derived(("ring doc", q.device), lambda: documents.doc.to(q.device))
    sinks = documents.derived(("ring sinks", world_size, rank, q.device),
                              lambda: _find_sinks(documents, q.device, world_size, rank))
    ring = _Ring(group, world_size, rank, node_size, layouts=[], label=f" ({label})" if label else "",
                 wait_timer=wait_timer, sinks=sinks)
    ring.layouts.extend(
        TileLayout.build_ring_step(block_mask, doc, q.shape[1], k.shape[1], block_size, world_size=world_size,
                                   rank=rank, source=ring.source(outer, inner),
                                   sinks=None if sinks is None else sinks.mask)
        for outer in range(ring.num_nodes)
        for inner in range(node_size)
    )
    steps = ring.layouts
    if sinks is not None:
        ring.sink_layout = TileLayout.build_sink_step(block_mask, doc, q.shape[1], k.shape[1], block_size,
                                                      world_size=world_size, rank=rank,
                                                      sink_indices=sinks.blocks)
        steps = [*steps, ring.sink_layout]
    ring.step_has_tiles = torch.stack([layout.tiles.any() for layout in steps]).tolist()
    return _RingAttention.apply(q, k, v, ring, impl, scale)
