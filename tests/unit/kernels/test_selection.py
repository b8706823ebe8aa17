"""select_blocks: structural guarantees, top-p monotonicity, the density cap, statistics and recall; the
striped selection's helpers and its group of one."""

import math

import pytest
import torch

from sparsebalance_pl.kernels import (
    LayerBudget,
    attention_recall,
    context_shard,
    rank_blocks,
    select_blocks,
    select_blocks_striped,
    select_with_budget,
    select_with_budget_striped,
)
from sparsebalance_pl.kernels import selection
from sparsebalance_pl.kernels.layout import candidate_tiles, forced_tiles, token_doc_ids
from sparsebalance_pl.kernels.recall import sampled_rows
from sparsebalance_pl.kernels.selection import estimate_block_mass

CU = torch.tensor([0, 70, 75, 200, 300], dtype=torch.int32)  # documents not aligned to blocks of 16 or 32


def smooth_features(num_tokens, heads, head_dim, gen):
    """Random low-frequency signals: nearby tokens look alike, so attention has structure to find."""
    t = torch.arange(num_tokens, dtype=torch.float32)[:, None, None, None]
    freq = torch.rand(1, heads, head_dim, 4, generator=gen) * 0.05
    phase = torch.rand(1, heads, head_dim, 4, generator=gen) * 2 * math.pi
    amp = torch.randn(1, heads, head_dim, 4, generator=gen)
    return (amp * torch.sin(freq * t + phase)).sum(-1)


def qk(seed, q_heads=4, kv_heads=2, head_dim=16, smooth=False, num_tokens=300):
    gen = torch.Generator().manual_seed(seed)
    if smooth:
        return smooth_features(num_tokens, q_heads, head_dim, gen), smooth_features(num_tokens, kv_heads, head_dim, gen)
    q = torch.randn(num_tokens, q_heads, head_dim, generator=gen)
    return q, torch.randn(num_tokens, kv_heads, head_dim, generator=gen)


def structure(block_size, cu=CU):
    doc = token_doc_ids(cu, int(cu[-1]))
    candidates = candidate_tiles(doc, block_size)
    return candidates, forced_tiles(doc, cu, block_size) & candidates


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tau,max_density", [(0.3, None), (0.8, None), (0.9, 0.3), (1.0, 0.5)])
def test_structure_and_cap(seed, tau, max_density):
    q, k = qk(seed)
    mask = select_blocks(q, k, CU, block_size=16, tau=tau, stride=8, max_density=max_density)
    candidates, forced = structure(16)
    assert mask.dtype == torch.bool and mask.shape == (4, 19, 19)
    assert not (mask & ~candidates).any()  # nothing above the diagonal, nothing across documents
    assert (mask | ~forced).all()  # diagonal and document-first blocks kept
    if max_density is not None:
        cap = torch.maximum(forced.sum(-1), (max_density * candidates.sum(-1)).floor().long())
        assert (mask.sum(-1) <= cap).all()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.7, 1.5])
def test_tile_budget_drops_the_least_mass_across_rows_and_heads(seed, fraction):
    q, k = qk(seed, smooth=True)
    ranking = rank_blocks(q, k, CU, block_size=16, stride=8)
    free, _ = ranking.select(0.95)
    assert torch.equal(free, select_blocks(q, k, CU, block_size=16, tau=0.95, stride=8))
    candidates, forced = structure(16)
    forced = forced.expand_as(free)
    budget = int(forced.sum() + fraction * (free & ~forced).sum())
    mask, stats = ranking.select(0.95, max_tiles=budget)
    assert torch.equal(stats.kept, mask.sum(-1)) and (mask | ~forced).all() and not (mask & ~free).any()
    assert int(mask.sum()) == min(budget, int(free.sum()))
    mass = estimate_block_mass(q, k, token_doc_ids(CU, 300), 16, 8, 16**-0.5)
    kept, dropped = mass[mask & ~forced], mass[free & ~mask]
    if kept.numel() and dropped.numel():
        assert kept.min() >= dropped.max() - 1e-6  # one threshold over the whole call, not one per row


@pytest.mark.parametrize("scale", [0.5, 1.0, 1.5])
def test_budget_selection_honours_the_density_scale_and_counts_base_densities(scale):
    q, k = qk(3, smooth=True)
    base = LayerBudget(0.8)
    budget = LayerBudget(0.9, None, scale)
    chosen = select_with_budget(q, k, CU, budget, base, block_size=16, stride=4)
    at_base = select_with_budget(q, k, CU, base, base, block_size=16, stride=4)
    assert torch.equal(at_base.mask, select_blocks(q, k, CU, block_size=16, tau=0.8, stride=4))
    base_tiles, kept = int(at_base.stats.kept.sum()), int(chosen.stats.kept.sum())
    forced = int(chosen.stats.ranking.forced.sum()) * q.shape[1]  # never dropped, whatever the scale
    bound = max(math.floor(scale * base_tiles), forced)
    unscaled = int(select_blocks(q, k, CU, block_size=16, tau=0.9, stride=4).sum())
    assert forced <= kept <= min(unscaled, bound) and int(chosen.mask.sum()) == kept
    if unscaled <= bound:
        assert kept == unscaled  # a scale that does not bind changes nothing
    # Base densities come from the base budget whatever budget is in use, one per document; so do the base's
    # layer density and estimated recall, beside the chosen budget's (what the move bought or cost).
    assert torch.allclose(chosen.base_document_density, at_base.base_document_density)
    assert torch.equal(chosen.base_stats.kept, at_base.stats.kept) and at_base.base_stats is at_base.stats
    assert torch.allclose(chosen.base_stats.mean_kept_mass(), at_base.stats.mean_kept_mass())
    moved = (chosen.stats.mean_density() - chosen.base_stats.mean_density(),
             chosen.stats.mean_kept_mass() - chosen.base_stats.mean_kept_mass())
    assert moved[0] * moved[1] >= 0  # more tiles never estimate less mass, and fewer never more
    assert chosen.base_document_density.shape == (len(CU) - 1,)
    assert ((chosen.base_document_density > 0) & (chosen.base_document_density <= 1)).all()
    # the base budget's mask, rebuilt from the moved selection's ranking, is the one selecting it gives
    assert torch.equal(chosen.base_stats.mask(), at_base.mask) and torch.equal(chosen.stats.mask(), chosen.mask)
    # and any budget's kept tiles follow from the base's stats without scoring again (how moves are priced)
    assert torch.equal(at_base.stats.under(budget).kept, chosen.stats.kept)
    assert torch.equal(at_base.stats.under(base).kept, at_base.stats.kept)


def test_a_base_budget_that_carries_a_density_scale_is_its_own_base():
    """A base budget with ``density_scale`` set (a configured cap on the layer's tiles) selected as itself: the
    scale bounds its own tiles; it used to fail reading the base counts it had not computed."""
    q, k = qk(3, smooth=True)
    base = LayerBudget(0.9, None, 0.5)
    capped = select_with_budget(q, k, CU, base, base, block_size=16, stride=4)
    plain = select_with_budget(q, k, CU, LayerBudget(0.9), LayerBudget(0.9), block_size=16, stride=4)
    forced = int(capped.stats.ranking.forced.sum()) * q.shape[1]
    assert int(capped.mask.sum()) <= max(math.floor(0.5 * int(plain.mask.sum())), forced)


def test_non_contiguous_inputs_give_the_same_mask():
    q, k = qk(3)
    q_t, k_t = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k))
    want = select_blocks(q, k, CU, block_size=16, tau=0.8, stride=8)
    assert torch.equal(select_blocks(q_t, k_t, CU, block_size=16, tau=0.8, stride=8), want)


def test_tau_one_keeps_every_candidate():
    q, k = qk(1)
    mask = select_blocks(q, k, CU, block_size=32, tau=1.0, stride=16)
    candidates, _ = structure(32)
    assert torch.equal(mask, candidates.expand_as(mask))


def test_density_grows_with_tau_and_stats_predict_other_taus():
    q, k = qk(2, smooth=True)
    taus = [0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 1.0]
    masks, stats = [], None
    for tau in taus:
        mask, s = select_blocks(q, k, CU, block_size=16, tau=tau, stride=8, return_stats=True)
        masks.append(mask)
        stats = stats or s
    for smaller, larger in zip(masks, masks[1:]):
        assert not (smaller & ~larger).any()  # same ranking, so the kept sets are nested
    candidates, _ = structure(16)
    densities = [float(m.sum() / (candidates.sum() * m.shape[0])) for m in masks]
    assert densities == sorted(densities)
    assert stats.density_at(taus).tolist() == pytest.approx(densities)
    capped = select_blocks(q, k, CU, block_size=16, tau=0.9, stride=8, max_density=0.4)
    assert float(stats.density_at([0.9], max_density=0.4)) == pytest.approx(
        float(capped.sum() / (candidates.sum() * capped.shape[0]))
    )


def test_stats_describe_the_mask():
    q, k = qk(4, smooth=True)
    mask, stats = select_blocks(q, k, CU, block_size=16, tau=0.7, stride=8, return_stats=True)
    candidates, _ = structure(16)
    assert torch.equal(stats.kept, mask.sum(-1))
    assert torch.equal(stats.candidates, candidates.sum(-1))
    assert float(stats.mean_density()) == pytest.approx(float(mask.sum() / (candidates.sum() * 4)))
    assert ((stats.kept_mass > 0) & (stats.kept_mass <= 1 + 1e-5)).all()
    assert float(stats.mean_kept_mass()) >= 0.7 - 1e-5
    assert stats.kept.shape == (4, 19)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tau", [0.5, 0.8, 0.9])
def test_exact_recall_reaches_tau_on_smooth_inputs(seed, tau):
    q, k = qk(seed, smooth=True)
    mask = select_blocks(q, k, CU, block_size=16, tau=tau, stride=8)
    recall = attention_recall(q, k, mask, CU, block_size=16, num_rows=128, seed=seed)
    assert float(recall) >= tau - 0.05


def test_recall_of_full_mask_is_one():
    q, k = qk(0)
    candidates, _ = structure(16)
    full = candidates.expand(4, -1, -1).clone()
    assert attention_recall(q, k, full, CU, block_size=16, per_head=True).tolist() == pytest.approx([1.0] * 4)


def test_stacked_masks_are_measured_on_the_same_rows_as_each_alone():
    """A moved budget and its base are priced on one softmax of the same rows: each recall is the one its mask
    gives alone, so their difference carries no sampling noise of its own."""
    q, k = qk(5, smooth=True)
    masks = [select_blocks(q, k, CU, block_size=16, tau=tau, stride=8) for tau in (0.6, 0.9)]
    alone = [attention_recall(q, k, m, CU, block_size=16, num_rows=40, per_head=True) for m in masks]
    stacked = attention_recall(q, k, torch.stack(masks), CU, block_size=16, num_rows=40, per_head=True)
    assert stacked.shape == (2, 4) and torch.allclose(stacked, torch.stack(alone), atol=1e-6)
    means = attention_recall(q, k, torch.stack(masks), CU, block_size=16, num_rows=40)
    assert means.tolist() == pytest.approx([float(a.mean()) for a in alone], abs=1e-6)
    assert float(means[1]) > float(means[0])  # the larger tau's nested mask keeps more of the same rows' mass
    with pytest.raises(ValueError, match="block_mask must be bool"):
        attention_recall(q, k, torch.stack(masks)[:, :2], CU, block_size=16)


def test_recall_measures_a_document_on_the_same_rows_wherever_it_is_packed():
    """Planners pack the same documents differently; their recalls must differ only by what the masks keep."""
    docs = [qk(seed, smooth=True, num_tokens=n) for seed, n in ((1, 96), (2, 160))]

    def packed(order):
        q, k = (torch.cat([docs[i][j] for i in order]) for j in (0, 1))
        cu = torch.tensor([0] + [sum(len(docs[i][0]) for i in order[: j + 1]) for j in range(len(order))],
                          dtype=torch.int32)
        mask = select_blocks(q, k, cu, block_size=16, tau=0.7, stride=8)  # documents aligned to blocks
        return attention_recall(q, k, mask, cu, block_size=16, num_rows=32, per_head=True)

    assert packed([0, 1]).tolist() == pytest.approx(packed([1, 0]).tolist(), abs=1e-6)
    rows, weights = sampled_rows(torch.tensor([0, 96, 256]), num_rows=32)
    assert rows.tolist()[:12] == sorted(torch.randperm(96, generator=torch.Generator().manual_seed(0))[:12].tolist())
    assert len(rows) == 12 + 20 and weights.tolist() == [8.0] * 32


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_size=16, tau=0.0), "tau"),
        (dict(block_size=16, tau=1.5), "tau"),
        (dict(block_size=48, tau=0.9), "block_size"),
        (dict(block_size=16, tau=0.9, stride=32), "stride"),
        (dict(block_size=16, tau=0.9, stride=3), "stride"),
        (dict(block_size=16, tau=0.9, max_density=0.0), "max_density"),
        (dict(block_size=16, tau=0.9, backend="fast"), "auto, torch, triton"),
    ],
)
def test_invalid_arguments(kwargs, match):
    q, k = qk(0)
    with pytest.raises(ValueError, match=match):
        select_blocks(q, k, CU, **kwargs)


# Selection for a block-striped stream (context parallelism); several ranks: tests/multiprocess/test_ring_selection.py


@pytest.mark.parametrize("chunk", [1 << 10, 1 << 24])  # many chunks of global blocks, and one
def test_rows_of_striped_blocks_score_as_the_whole_stream(monkeypatch, chunk):
    monkeypatch.setattr(selection, "_CHUNK_ELEMENTS", chunk)
    q, k = qk(5, smooth=True, num_tokens=384)
    cu = torch.tensor([0, 7, 50, 181, 300, 384], dtype=torch.int32)
    doc = token_doc_ids(cu, 384)
    whole = estimate_block_mass(q, k, doc, 16, 4, 0.25)
    assert torch.equal(estimate_block_mass(q, k, doc, 16, 4, 0.25, q_blocks=torch.arange(24)), whole)
    for world_size in (2, 3, 4):
        for rank in range(world_size):
            rows = estimate_block_mass(context_shard(q, world_size=world_size, rank=rank, block_size=16), k, doc,
                                       16, 4, 0.25, q_blocks=torch.arange(rank, 24, world_size))
            # Same scores in matmuls of fewer rows: BLAS may round them an ulp apart.
            torch.testing.assert_close(rows, whole[:, rank::world_size], rtol=1e-6, atol=1e-7)


def test_order_keys_sort_as_the_floats():
    values = torch.tensor([0.3, -1.0, 0.0, -0.0, 1.0, 1e-30, -2.5, float("inf"), -float("inf"), 0.3, 2.0**-149])
    keys = selection._order_keys(values)
    assert torch.equal(values[keys.argsort(stable=True)], values.sort(stable=True).values)
    assert torch.equal(keys[:, None] == keys[None, :], values[:, None] == values[None, :])  # -0 is +0


def test_order_statistic_of_a_group_of_one_is_the_sorted_key(monkeypatch):
    monkeypatch.setattr(selection.dist, "all_reduce", lambda tensor, group=None: None)  # one rank: its own counts
    gen = torch.Generator().manual_seed(0)
    mass = torch.where(torch.rand(500, generator=gen) < 0.3, -1.0, torch.rand(500, generator=gen).round(decimals=2))
    keys = selection._order_keys(mass)
    ordered = keys.sort(descending=True).values
    for index in (0, 1, 17, 149, 250, 350, 498, 499):
        assert selection._group_order_statistic(keys, torch.tensor(index), None) == int(ordered[index])


def test_striped_selection_of_one_rank_is_the_whole_stream_selection():
    q, k = qk(6, smooth=True)
    mask, stats = select_blocks_striped(q, k, CU, block_size=16, tau=0.8, stride=8, return_stats=True)
    want, want_stats = select_blocks(q, k, CU, block_size=16, tau=0.8, stride=8, return_stats=True)
    assert torch.equal(mask, want) and torch.equal(stats.kept, want_stats.kept)
    budget, base = LayerBudget(0.9, None, 0.7), LayerBudget(0.8)
    got = select_with_budget_striped(q, k, CU, budget, base, block_size=16, stride=4)
    want = select_with_budget(q, k, CU, budget, base, block_size=16, stride=4)
    assert torch.equal(got.mask, want.mask) and torch.equal(got.stats.kept, want.stats.kept)
    assert torch.equal(got.base_document_density, want.base_document_density)
