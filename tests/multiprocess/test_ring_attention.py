"""sparse_ring_attention over W = 2 and 4 gloo ranks, flat and hierarchical rings, equals
block_sparse_attention on the whole stream.

Every rank builds the same stream (documents shorter than a block, documents crossing stripe boundaries,
a padding document at the tail), runs the ring on its striped shard forward and backward for each case,
and saves its output and gradient shards; the test gathers them with context_unshard and compares with
one process holding the whole stream, and with the dense fp64 reference.
"""

import os
import time
from pathlib import Path

import pytest
import torch
from rank_runner import run_ranks

from sparsebalance_pl.kernels import (
    block_sparse_attention,
    context_shard,
    context_unshard,
    reference_block_sparse_attention,
)
from sparsebalance_pl.kernels.launches import count_launches
from sparsebalance_pl.kernels.layout import PackedDocuments, forced_tiles, striped_blocks, token_doc_ids
from sparsebalance_pl.timing import AttentionTimer

BLOCK = 16
# name: (tokens, dtype, backend, mask kind, ranks per node (None: flat ring), relative error allowed against
# the whole-stream kernel; measured about 3e-16 in fp64 and 2e-7 in fp32)
CASES = {
    "random_fp64": (256, torch.float64, "torch", "random", None, 1e-12),
    "dense_fp32": (256, torch.float32, "torch", None, None, 1e-6),
    "empty_rows_fp32": (256, torch.float32, "torch", "sparse", None, 1e-6),
    "two_per_node_fp64": (256, torch.float64, "torch", "random", 2, 1e-12),  # 4 ranks: 2 nodes x 2
    "one_per_node_fp64": (256, torch.float64, "torch", "sparse", 1, 1e-12),  # outer ring only
}
if os.environ.get("TRITON_INTERPRET") == "1":  # gloo ranks hold CPU tensors: Triton only under the interpreter
    CASES["triton_fp32"] = (128, torch.float32, "triton", "random", None, 1e-6)
    CASES["triton_two_per_node_fp32"] = (128, torch.float32, "triton", "random", 2, 1e-6)


def _stream(name):
    """Inputs of the whole stream and the upstream gradient, the same on every rank."""
    tokens, dtype, _, kind, _, _ = CASES[name]
    gen = torch.Generator().manual_seed(tokens + len(str(kind)))  # flat and hierarchical cases share streams
    cu = torch.tensor([0, 7, 50, tokens // 2 + 3, tokens - 40, tokens], dtype=torch.int32)  # last: padding doc
    q = torch.randn(tokens, 4, 16, generator=gen, dtype=dtype)
    k, v = (torch.randn(tokens, 2, 16, generator=gen, dtype=dtype) for _ in range(2))
    grad = torch.randn(tokens, 4, 16, generator=gen, dtype=dtype)
    nb = tokens // BLOCK
    if kind is None:
        return q, k, v, grad, cu, None
    mask = torch.rand(4, nb, nb, generator=gen) < (0.5 if kind == "random" else 0.15)
    if kind == "random":
        mask |= forced_tiles(token_doc_ids(cu, tokens), cu, BLOCK)
    else:  # nothing kept for whole query blocks, and steps where some ranks keep nothing
        mask[0, 5] = False
        mask[3, nb - 1] = False
    return q, k, v, grad, cu, mask


class _CountingTimer(AttentionTimer):
    def __init__(self, device):
        super().__init__(device)
        self.count = 0

    def start(self, key):
        self.count += 1
        super().start(key)


def _ring_rank(rank, world_size, out_dir):
    import torch.distributed as dist

    from sparsebalance_pl.kernels import sparse_ring_attention

    results = {}
    for name, (_, _, backend, _, node_size, _) in CASES.items():
        q, k, v, grad, cu, mask = _stream(name)
        q, k, v, grad = (context_shard(x, world_size=world_size, rank=rank, block_size=BLOCK) for x in (q, k, v, grad))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        group = dist.new_group(list(range(world_size))) if name == "dense_fp32" else None  # explicit group too
        out = sparse_ring_attention(q, k, v, cu, block_size=BLOCK, block_mask=mask, backend=backend, group=group,
                                    node_size=node_size)
        results[name] = (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))
        if name == "random_fp64" and node_size is None:  # only this rank's rows of the mask: the same result
            rows = mask[:, striped_blocks(mask.shape[1], world_size, rank)]
            waits = _CountingTimer(torch.device("cpu"))
            start = time.perf_counter()
            out = sparse_ring_attention(q, k, v, cu, block_size=BLOCK, block_mask=rows, backend=backend,
                                        wait_timer=waits)
            results["own_rows"] = (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))
            results["waits"] = (waits.count, waits.seconds(), time.perf_counter() - start)
        if name == "triton_fp32":  # the ring's host reads, which stall a GPU: one per call, whatever its steps
            documents = PackedDocuments(cu, q.shape[0] * world_size, BLOCK)  # once per stream, as a model's layers

            def forward_and_backward():
                out = sparse_ring_attention(q, k, v, documents, block_size=BLOCK, block_mask=mask, backend=backend)
                torch.autograd.grad(out, (q, k, v), grad)

            forward_and_backward()  # the stream's first call finds its sink blocks, once for every later call
            with count_launches(as_device=True) as count:
                forward_and_backward()
            results["host_reads"] = dict(count.syncs)
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def _relative_error(x, ref):
    return float((x.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_equals_whole_stream_attention(world_size, tmp_path):
    assert run_ranks(_ring_rank, world_size, str(tmp_path), world_size=world_size, timeout=300) == {}
    shards = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    assert all(torch.equal(a, b) for shard in shards for a, b in zip(shard["own_rows"], shard["random_fp64"]))
    for shard in shards:  # waits: W - 1 for K/V forward, W - 1 for K/V and W for dK/dV backward, and the sink
        count, waited, call = shard["waits"]  # blocks' sums (forward and backward): all part of the call
        assert count == 3 * world_size and 0 < waited < call
        if "triton_fp32" in CASES:  # which steps keep any tile, read at once (with sink blocks on 2 ranks, none on 4)
            assert shard["host_reads"] == {"Tensor.tolist": 1}
    for name, (tokens, dtype, backend, _, _, tolerance) in CASES.items():
        got = [context_unshard([s[name][i] for s in shards], block_size=BLOCK) for i in range(4)]
        q, k, v, grad, cu, mask = _stream(name)
        mask = torch.ones(4, tokens // BLOCK, tokens // BLOCK, dtype=torch.bool) if mask is None else mask
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        whole = block_sparse_attention(q, k, v, mask, cu, block_size=BLOCK, backend=backend)
        reference = reference_block_sparse_attention(q, k, v, mask, cu, block_size=BLOCK)
        want = [whole.detach(), *torch.autograd.grad(whole, (q, k, v), grad)]
        exact = [reference.detach(), *torch.autograd.grad(reference, (q, k, v), grad.double())]
        for what, g, w, e in zip(("out", "dq", "dk", "dv"), got, want, exact):
            assert torch.isfinite(g).all(), f"{name}: {what}"
            assert _relative_error(g, w) <= tolerance, f"{name}: {what} against block_sparse_attention"
            assert _relative_error(g, e) <= 10 * tolerance, f"{name}: {what} against the fp64 reference"
        if name == "two_per_node_fp64":  # the hierarchical ring gives the flat ring's result
            flat = [context_unshard([s["random_fp64"][i] for s in shards], block_size=BLOCK) for i in range(4)]
            assert all(_relative_error(g, f) <= 1e-12 for g, f in zip(got, flat))
        if name == "empty_rows_fp32":  # head 0, query block 5 and head 3, the last block see nothing
            assert torch.all(got[0][5 * BLOCK : 6 * BLOCK, 0] == 0) and torch.all(got[0][-BLOCK:, 3] == 0)


def _late_rank(rank, out_dir):
    import datetime
    import time

    import torch.distributed as dist

    from sparsebalance_pl.kernels import sparse_ring_attention

    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    if rank == 1:  # never joins the ring
        time.sleep(6)
        return
    q, k, v = torch.randn(64, 2, 16), torch.randn(64, 1, 16), torch.randn(64, 1, 16)
    try:
        cu = torch.tensor([0, 32, 64, 96, 128], dtype=torch.int32)  # no document longer than 2 blocks: no sinks
        sparse_ring_attention(q, k, v, cu, block_size=BLOCK, group=group, label="layer 3")
    except RuntimeError as err:
        (Path(out_dir) / "error.txt").write_text(str(err))


@pytest.mark.slow
def test_a_rank_that_does_not_join_the_ring_ends_the_call_naming_rank_layer_and_step(tmp_path):
    assert run_ranks(_late_rank, str(tmp_path), world_size=2, timeout=60) == {}
    message = (tmp_path / "error.txt").read_text()
    assert message.startswith("ring attention (layer 3): rank 0 got no K/V from rank 1 at ring step 0")
    assert "Timed out" in message  # is_collective_failure: the strategy then stops every rank
