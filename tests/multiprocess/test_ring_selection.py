"""Block selection for a block-striped stream over W = 2 and 4 gloo ranks equals select_blocks on the whole
stream, and selection then sparse_ring_attention equals select_blocks then block_sparse_attention.

Every rank builds the same stream (a document shorter than a block, documents crossing stripe boundaries,
a padding document at the tail), selects on its shards for several top-p thresholds, a density cap and
DST layer budgets whose ``density_scale`` binds (one group-wide threshold), and saves its masks, kept
counts and base densities; the test compares them with one process holding the whole stream.
"""

import pytest
import torch
from rank_runner import run_ranks

from sparsebalance_pl.kernels import (
    LayerBudget,
    block_sparse_attention,
    context_shard,
    context_unshard,
    select_blocks,
    select_with_budget,
)

BLOCK, STRIDE, TOKENS = 16, 4, 384
CU = torch.tensor([0, 7, 50, 181, 300, 344, TOKENS], dtype=torch.int32)  # last: padding document
TAUS = [(0.3, None), (0.7, None), (0.9, None), (1.0, None), (0.9, 0.4)]
BASE = LayerBudget(0.8)
# Scales 0.7 and 0.75 bind, and on this stream a threshold per rank (each rank cutting its rows to its own
# share) keeps other tiles than the whole stream for W = 2 and 4: only a group-wide threshold passes.
BUDGETS = [BASE, LayerBudget(0.9, None, 0.7), LayerBudget(0.95, 0.5, 0.75), LayerBudget(0.9, None, 1.5)]


def _stream():
    """Smooth q, k (attention has structure, so top-p keeps some blocks and drops others), random v and
    upstream gradient, fp64, the same on every rank."""
    gen = torch.Generator().manual_seed(7)
    t = torch.arange(TOKENS, dtype=torch.float64)[:, None, None, None]

    def smooth(heads):
        freq, phase = (torch.rand(1, heads, 16, 4, generator=gen, dtype=torch.float64) for _ in range(2))
        amp = torch.randn(1, heads, 16, 4, generator=gen, dtype=torch.float64)
        return (amp * torch.sin(0.05 * freq * t + 6.3 * phase)).sum(-1)

    q, k = smooth(4), smooth(2)
    v = torch.randn(TOKENS, 2, 16, generator=gen, dtype=torch.float64)
    grad = torch.randn(TOKENS, 4, 16, generator=gen, dtype=torch.float64)
    return q, k, v, grad


def _selection_rank(rank, world_size, out_dir):
    import torch.distributed as dist

    from sparsebalance_pl.kernels import select_blocks_striped, select_with_budget_striped, sparse_ring_attention

    shard = lambda x: context_shard(x, world_size=world_size, rank=rank, block_size=BLOCK)  # noqa: E731
    q, k, v, grad = (shard(x) for x in _stream())
    group = dist.new_group(list(range(world_size)))
    results = {}
    for tau, cap in TAUS:
        mask, stats = select_blocks_striped(q, k, CU, block_size=BLOCK, tau=tau, stride=STRIDE, max_density=cap,
                                            group=group, return_stats=True)
        results[tau, cap] = (mask, stats.kept)
    for budget in BUDGETS:
        chosen = select_with_budget_striped(q, k, CU, budget, BASE, block_size=BLOCK, stride=STRIDE)
        results[repr(budget)] = (chosen.mask, chosen.stats.kept, chosen.base_document_density)
    mask = select_blocks_striped(q, k, CU, block_size=BLOCK, tau=0.8, stride=STRIDE)
    try:  # a shard that is not whole blocks stops before any collective, on every rank alike
        select_blocks_striped(q[1:], k[1:], CU, block_size=BLOCK, tau=0.8, stride=STRIDE)
        raise AssertionError("a shard of a partial block was accepted")
    except ValueError as err:
        assert "not a multiple of block_size" in str(err)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = sparse_ring_attention(q, k, v, CU, block_size=BLOCK, block_mask=mask, backend="torch")
    results["attention"] = (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def _check_rows(got, want, rank, world_size, what):
    """A rank's global-layout mask holds the whole stream's rows of its query blocks and nothing else."""
    rows = torch.zeros(want.shape[1], dtype=torch.bool)
    rows[rank::world_size] = True
    assert torch.equal(got[:, rows], want[:, rows]), f"{what}: rank {rank}'s rows differ from the whole stream's"
    assert not got[:, ~rows].any(), f"{what}: rank {rank} filled other ranks' rows"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_striped_selection_equals_whole_stream_selection(world_size, tmp_path):
    assert run_ranks(_selection_rank, world_size, str(tmp_path), world_size=world_size, timeout=300) == {}
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    q, k, v, grad = _stream()
    for tau, cap in TAUS:
        want, stats = select_blocks(q, k, CU, block_size=BLOCK, tau=tau, stride=STRIDE, max_density=cap,
                                    return_stats=True)
        for rank, result in enumerate(ranks):
            mask, kept = result[tau, cap]
            _check_rows(mask, want, rank, world_size, f"tau {tau}, max_density {cap}")
            assert torch.equal(kept, stats.kept[:, rank::world_size])
    unscaled = int(select_blocks(q, k, CU, block_size=BLOCK, tau=0.9, stride=STRIDE).sum())
    for budget in BUDGETS:
        want = select_with_budget(q, k, CU, budget, BASE, block_size=BLOCK, stride=STRIDE)
        for rank, result in enumerate(ranks):
            mask, kept, base_density = result[repr(budget)]
            _check_rows(mask, want.mask, rank, world_size, f"{budget}")
            assert torch.equal(kept, want.stats.kept[:, rank::world_size])
            assert torch.equal(base_density, want.base_document_density)
        if budget == BUDGETS[1]:  # the scale binds, so the group-wide threshold decides tiles
            assert 0 < int(want.mask.sum()) < unscaled
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    mask = select_blocks(q.detach(), k.detach(), CU, block_size=BLOCK, tau=0.8, stride=STRIDE)
    assert 0 < int(mask.sum()) < int(select_blocks(q.detach(), k.detach(), CU, block_size=BLOCK, tau=1.0).sum())
    whole = block_sparse_attention(q, k, v, mask, CU, block_size=BLOCK, backend="torch")
    want = [whole.detach(), *torch.autograd.grad(whole, (q, k, v), grad)]
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        got = context_unshard([result["attention"][i] for result in ranks], block_size=BLOCK)
        error = float((got - want[i]).norm() / want[i].norm())
        assert error <= 1e-9, f"{what}: relative error {error:.2e} against the whole stream"
