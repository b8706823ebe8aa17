"""Selection options (``SELECTION_OPTIONS``): always-kept sinks and local windows, the sampled estimate, recall
probes (an honest estimated recall) and per-head taus, each against an fp64 reference or its definition."""

import pytest
import torch

from sparsebalance_pl.kernels import attention_recall, rank_blocks, select_blocks
from sparsebalance_pl.kernels.layout import candidate_tiles, forced_tiles, token_doc_ids
from sparsebalance_pl.kernels.selection import probe_block_mass, sampled_block_mass, selection_options

CU = torch.tensor([0, 70, 75, 200, 300], dtype=torch.int32)  # documents not aligned to blocks of 16


def smooth_features(num_tokens, heads, head_dim, gen):
    t = torch.arange(num_tokens, dtype=torch.float32)[:, None, None, None]
    freq = torch.rand(1, heads, head_dim, 4, generator=gen) * 0.05
    phase = torch.rand(1, heads, head_dim, 4, generator=gen) * 6.283
    amp = torch.randn(1, heads, head_dim, 4, generator=gen)
    return (amp * torch.sin(freq * t + phase)).sum(-1)


def qk(seed, smooth=False, num_tokens=300):
    gen = torch.Generator().manual_seed(seed)
    if smooth:
        return smooth_features(num_tokens, 4, 16, gen), smooth_features(num_tokens, 2, 16, gen)
    return torch.randn(num_tokens, 4, 16, generator=gen), torch.randn(num_tokens, 2, 16, generator=gen)

SCALE = 16**-0.5


def test_forced_tiles_keep_sinks_and_a_local_window():
    cu = torch.tensor([0, 40, 128], dtype=torch.int32)  # blocks of 16: doc 0 in blocks 0-2, doc 1 from block 2
    doc = token_doc_ids(cu, 128)
    assert torch.equal(forced_tiles(doc, cu, 16), forced_tiles(doc, cu, 16, sink_blocks=1, local_blocks=1))
    forced = forced_tiles(doc, cu, 16, sink_blocks=2, local_blocks=3) & candidate_tiles(doc, 16)
    # Block 6: its document starts in block 2, so sinks 2 and 3, window 4-6.
    assert forced[6].nonzero().flatten().tolist() == [2, 3, 4, 5, 6]
    # Block 1 (document 0): sinks 0 and 1, window 0-1; never a key block after the query block.
    assert forced[1].nonzero().flatten().tolist() == [0, 1]
    assert not forced.triu(1).any()
    none = forced_tiles(doc, cu, 16, sink_blocks=0, local_blocks=1)
    assert torch.equal(none, torch.eye(8, dtype=torch.bool))
    with pytest.raises(ValueError, match="local_blocks"):
        forced_tiles(doc, cu, 16, local_blocks=0)


def sampled_reference(q, k, cu, block_size, stride):
    """fp64, token by token: each query token's softmax over one sampled key per stride group."""
    num_tokens, num_q_heads, _ = q.shape
    group = num_q_heads // k.shape[1]
    doc = token_doc_ids(cu, num_tokens)
    nb = -(-num_tokens // block_size)
    mass = torch.zeros(num_q_heads, nb, nb, dtype=torch.float64)
    for t in range(num_tokens):
        keys = torch.arange(0, num_tokens, stride) + stride - 1 - t % stride
        keys = keys[(keys <= t) & (keys < num_tokens)]
        keys = keys[doc[keys] == doc[t]]
        if keys.numel() == 0:
            continue
        for h in range(num_q_heads):
            scores = k[keys, h // group].double() @ q[t, h].double() * SCALE
            mass[h, t // block_size].index_add_(0, keys // block_size, torch.softmax(scores, 0))
    return mass / mass.sum(-1, keepdim=True)


@pytest.mark.parametrize("block_size,stride", [(16, 4), (32, 8), (16, 16)])
def test_sampled_estimate_matches_an_fp64_reference(block_size, stride):
    q, k = qk(1)
    doc = token_doc_ids(CU, 300)
    got = sampled_block_mass(q, k, doc, block_size, stride, SCALE)
    assert torch.allclose(got.double(), sampled_reference(q, k, CU, block_size, stride), atol=1e-5)


def test_sampled_estimate_of_striped_rows_is_the_whole_streams():
    q, k = qk(2, num_tokens=256)
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    doc = token_doc_ids(cu, 256)
    whole = sampled_block_mass(q, k, doc, 16, 4, SCALE)
    blocks = torch.arange(1, 16, 3)
    rows = torch.cat([q[b * 16:(b + 1) * 16] for b in blocks.tolist()])
    assert torch.allclose(sampled_block_mass(rows, k, doc, 16, 4, SCALE, q_blocks=blocks), whole[:, blocks], atol=1e-6)


def test_probes_are_exact_attention_rows():
    q, k = qk(3)
    doc = token_doc_ids(CU, 300)
    probes = probe_block_mass(q, k, doc, 16, SCALE, 2)
    # fp64 reference of every token's exact block mass; the probes must be the mean of two of the block's rows.
    kr = k.double().repeat_interleave(2, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), kr) * SCALE
    t = torch.arange(300)
    allowed = (t[None, :] <= t[:, None]) & (doc[None, :] == doc[:, None])
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    rows = torch.nn.functional.pad(probs, (0, 4)).view(4, 300, 19, 16).sum(-1)  # [H, T, nB]
    draws = torch.rand(19, 2, generator=torch.Generator().manual_seed(0))
    sizes = (300 - torch.arange(19) * 16).clamp(max=16)
    pos = torch.arange(19)[:, None] * 16 + (draws * sizes[:, None]).long()
    assert torch.allclose(probes.double(), rows[:, pos].mean(2), atol=1e-5)


@pytest.mark.parametrize("estimate", ["antidiagonal", "sampled"])
def test_recall_probes_make_the_estimated_recall_honest(estimate):
    q, k = qk(4, smooth=True, num_tokens=512)
    cu = torch.tensor([0, 200, 512], dtype=torch.int32)
    plain = rank_blocks(q, k, cu, block_size=16, stride=4, estimate=estimate)
    probed = rank_blocks(q, k, cu, block_size=16, stride=4, estimate=estimate, recall_probes=8)
    mask, stats = probed.select(0.7)
    assert torch.equal(mask, plain.select(0.7)[0])  # probes move the estimate, not the selection
    exact = attention_recall(q, k, mask, cu, block_size=16, num_rows=512, per_head=True)
    estimated = stats.kept_mass.mean(dim=1)
    assert (estimated - exact).abs().max() < 0.03


def test_per_head_tau_reaches_the_target_on_the_probes_with_the_least_grid_threshold():
    q, k = qk(5, smooth=True, num_tokens=512)
    cu = torch.tensor([0, 512], dtype=torch.int32)
    ranking = rank_blocks(q, k, cu, block_size=16, stride=4, recall_probes=2, per_head_tau=True)
    for tau in (0.6, 0.8, 0.95):
        mask, stats = ranking.select(tau)
        probe_recall = ranking.probe_cumulative.gather(-1, (stats.kept - 1)[..., None])[..., 0].mean(1)
        assert (probe_recall >= tau - 1e-6).all()
        assert (stats.kept_mass.mean(1) >= tau - 1e-5).all()
    denser = ranking.kept_at([0.6, 0.8, 0.95])
    assert (denser[..., 1:] >= denser[..., :-1]).all()  # higher targets never keep fewer blocks


@pytest.mark.parametrize(
    "options,error,match",
    [
        (dict(estimate="pooled"), ValueError, "estimate"),
        (dict(sink_blocks=-1), ValueError, "sink_blocks"),
        (dict(local_blocks=0), ValueError, "local_blocks"),
        (dict(recall_probes=-2), ValueError, "recall_probes"),
        (dict(per_head_tau=True), ValueError, "per_head_tau"),
        (dict(window=3), TypeError, "unknown selection options"),
    ],
)
def test_invalid_options(options, error, match):
    with pytest.raises(error, match=match):
        selection_options(**options)
    q, k = qk(0)
    with pytest.raises(error, match=match):
        select_blocks(q, k, CU, block_size=16, tau=0.9, **options)


def test_default_options_are_the_plain_selection():
    q, k = qk(6, smooth=True)
    plain = select_blocks(q, k, CU, block_size=16, tau=0.8, stride=4)
    same = select_blocks(q, k, CU, block_size=16, tau=0.8, stride=4, estimate="antidiagonal", sink_blocks=1,
                         local_blocks=1, recall_probes=0, per_head_tau=False)
    assert torch.equal(plain, same)
    window = select_blocks(q, k, CU, block_size=16, tau=0.3, stride=4, local_blocks=3, sink_blocks=2)
    doc = token_doc_ids(CU, 300)
    forced = forced_tiles(doc, CU, 16, sink_blocks=2, local_blocks=3) & candidate_tiles(doc, 16)
    assert (window | ~forced).all()  # every head keeps the window and the sinks
