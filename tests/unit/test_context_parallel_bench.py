"""The layout balance computation of benchmarks/context_parallel.py, on synthetic masks."""

import sys

import pytest
import torch
from main_runner import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import context_parallel as cp  # noqa: E402

from sparsebalance_pl.kernels.layout import TileLayout, striped_blocks, token_doc_ids  # noqa: E402


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_every_rank_holds_an_equal_share_of_the_blocks(layout, world_size):
    owner = cp.owners(32, world_size, layout)
    assert torch.bincount(owner, minlength=world_size).tolist() == [32 // world_size] * world_size
    blocks = torch.cat([torch.nonzero(owner == r).flatten() for r in range(world_size)])
    assert sorted(blocks.tolist()) == list(range(32))  # rank order of the blocks is a permutation


def test_owners_of_each_layout():
    assert cp.owners(8, 2, "contiguous").tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert cp.owners(8, 2, "zigzag").tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    assert cp.owners(8, 2, "striped").tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert torch.equal(torch.nonzero(cp.owners(16, 4, "striped") == 3).flatten(), striped_blocks(16, 4, 3))
    with pytest.raises(ValueError, match="equal parts of the zigzag"):
        cp.owners(12, 4, "zigzag")


def test_dense_causal_mask_is_balanced_by_striping_and_zigzag_not_by_contiguous_chunks():
    nb, w = 256, 8
    causal = torch.ones(2, nb, nb, dtype=torch.bool).tril()
    striped, zigzag, contiguous = (cp.layout_balance(causal, w, x) for x in ("striped", "zigzag", "contiguous"))
    # 32 blocks per rank: rank r's rows hold r + 1 tiles more than rank 0's per row, (W - 1) / 2 above the mean
    assert striped["total_imbalance"] == pytest.approx((8 * 496 + 32 * 8) / (8 * 496 + 32 * 4.5))
    assert striped["step_imbalance"] < 1.03
    assert zigzag["total_imbalance"] == pytest.approx(1.0)
    assert contiguous["total_imbalance"] > 1.8  # the last chunk's rows see the whole stream
    assert contiguous["step_imbalance"] > 2.5  # and ranks whose source lies after them have nothing at a step
    for b in (striped, zigzag, contiguous):
        assert sum(b["rank_tiles"]) == int(causal.sum())
        assert sum(map(sum, b["step_tiles"])) == int(causal.sum())
        assert b["sync_cost"] >= b["total_imbalance"] - 1e-12


def test_a_concave_row_profile_unbalances_zigzag_but_not_striping():
    """Top-p keeps fewer tiles per row than causality allows, growing slower than the row index: zigzag pairs
    chunks whose sums then differ; striping samples every part of the stream alike."""
    nb = 256
    i = torch.arange(nb)
    width = (i.double() + 1).sqrt().ceil().long()  # row i keeps its last ~sqrt(i) blocks
    mask = ((i[:, None] - i[None, :]) >= 0) & ((i[:, None] - i[None, :]) < width[:, None])
    for w in (4, 8):
        striped, zigzag, contiguous = (cp.layout_balance(mask[None], w, x) for x in ("striped", "zigzag", "contiguous"))
        assert striped["total_imbalance"] < 1.01
        assert 1.05 < zigzag["total_imbalance"] < 1.3 < contiguous["total_imbalance"]
        assert striped["step_imbalance"] < 1.01 < 1.1 < zigzag["step_imbalance"]


def test_ring_steps_follow_the_ring_schedule():
    matrix = torch.arange(9).view(3, 3)  # [query rank, key rank]
    steps = cp.ring_steps(matrix)
    assert steps[0].tolist() == [0, 4, 8]  # own K/V
    assert steps[1].tolist() == [matrix[0, 2], matrix[1, 0], matrix[2, 1]]  # K/V of rank r - 1


def test_computed_striped_counts_equal_the_ring_layouts():
    nb, block, w = 16, 4, 4
    cu = torch.tensor([0, 10, 37, 64], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(3, nb, nb, generator=gen) < 0.4
    kept = mask & cp.candidates_of(cu, 64, block)
    steps = cp.ring_steps(cp.tile_matrix(kept, cp.owners(nb, w, "striped"), w))
    doc = token_doc_ids(cu, 64)
    for rank in range(w):
        for t in range(w):
            layout = TileLayout.build_ring_step(mask, doc, 3, 1, block, world_size=w, rank=rank, source=(rank - t) % w)
            assert layout.rows().tile_col.numel() == steps[t, rank]


def test_bad_arguments_fail_in_one_line(capsys):
    with pytest.raises(SystemExit, match="--world-sizes: 3 is not a power of two") as err:
        cp.parse_args(["--world-sizes", "3"])
    assert "\n" not in str(err.value)
    with pytest.raises(SystemExit, match="does not split into 2W"):
        cp.parse_args(["--streams", "doc8k", "--world-sizes", "128"])
    with pytest.raises(SystemExit, match="is not a local Hugging Face model directory"):
        cp.parse_args(["--model", "/nonexistent/model"])


def test_sinks_held_by_every_rank_count_at_the_own_step():
    cu = torch.tensor([0, 40, 64], dtype=torch.int32)  # two documents: sinks in blocks 0 and 5 (B = 8)
    sinks = cp.sink_blocks(cu, 8, 8, 2)  # both documents span more than 2 blocks
    assert torch.nonzero(sinks).flatten().tolist() == [0, 5]
    kept = cp.candidates_of(cu, 64, 8)
    plain = cp.tile_matrix(kept, cp.owners(8, 2, "striped"), 2)
    local = cp.tile_matrix(kept, cp.owners(8, 2, "striped"), 2, sinks)
    assert local.sum() == plain.sum()
    # rank 0's block 6 sees sink 5 (rank 1's); rank 1's blocks 1, 3 see sink 0 (rank 0's), 5 and 7 their own
    assert (local - plain).tolist() == [[1, -1], [-2, 2]]
