"""Selection quality over every query row: selection variants from the command line, held-out streams of exact
length, the exact masked attention and its recall, and the passes through a model built with it."""

import numpy as np
import pytest
import torch

from sparsebalance_pl.attention import varlen_causal_attention
from sparsebalance_pl.errors import ConfigError, DataError
from sparsebalance_pl.model import ModelConfig
from sparsebalance_pl.selection_quality import (
    IMPLEMENTATION, SelectionVariant, dense_losses, masked_attention, pack_streams, sparse_pass, summarise,
)

TINY = {"num_layers": 2, "hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128}


def test_a_selection_variant_splits_ranking_options_from_budgets():
    variant = SelectionVariant.parse("late:estimate=sampled,stride=8,per_head_tau=false,tau=0.85,"
                                     "late_tau=0.9,late_from=3")
    assert variant.rank_kwargs == {"estimate": "sampled", "stride": 8, "per_head_tau": False}
    assert (variant.tau, variant.layer_tau(2, 0.5), variant.layer_tau(3, 0.5)) == (0.85, 0.85, 0.9)
    assert SelectionVariant.parse("base").layer_tau(0, 0.5) == 0.5 and SelectionVariant.parse("base").describe() == (
        "default")


@pytest.mark.parametrize("spec, message", [("a:stride", "is not field=value"), ("a:blok=3", "unknown key 'blok'"),
                                           ("a:late_tau=0.9", "go together"), ("a:per_head_tau=no", "true or false")])
def test_a_bad_selection_variant_is_one_line_naming_it(spec, message):
    with pytest.raises(ConfigError, match=message):
        SelectionVariant.parse(spec)


def test_streams_have_the_exact_length_and_cut_the_document_that_crosses_their_end():
    docs = [np.arange(1000 * i, 1000 * i + n) for i, n in enumerate([300, 1, 200, 500, 250, 400, 350, 300])]
    streams = pack_streams(docs, 512, 2, seed=0)
    for s in streams:
        assert s["input_ids"].numel() == 512 == int(s["cu_seqlens"][-1]) == sum(s["doc_lengths"])
        assert (s["targets"][s["cu_seqlens"][1:] - 1] == -100).all()  # no target across a document's end
        assert s["position_ids"][s["cu_seqlens"][:-1].long()].eq(0).all()
    assert 1 not in streams[0]["doc_lengths"] + streams[1]["doc_lengths"]  # a 1-token document has no target
    assert [s["input_ids"].tolist() for s in pack_streams(docs, 512, 2, seed=0)] == [
        s["input_ids"].tolist() for s in streams]
    with pytest.raises(DataError, match="streams of 512 tokens from 8 held-out documents"):
        pack_streams(docs, 512, 5, seed=0)


def test_the_masked_attention_is_exact_on_the_kept_tiles_and_measures_their_mass():
    torch.manual_seed(0)
    cu = torch.tensor([0, 96, 256], dtype=torch.int32)
    q, k, v = torch.randn(256, 4, 16), torch.randn(256, 2, 16), torch.randn(256, 2, 16)
    full = torch.ones(4, 8, 8, dtype=torch.bool)
    out, recall = masked_attention(q, k, v, full, cu, 32, None)
    torch.testing.assert_close(out, varlen_causal_attention(q, k, v, cu))
    torch.testing.assert_close(recall, torch.ones(4, 256))
    local = full & torch.eye(8, dtype=torch.bool)  # each query block keeps its own block only
    out, recall = masked_attention(q, k, v, local, cu, 32, None)
    assert recall[:, :32].allclose(torch.ones(4, 32)) and (recall[:, 128:] < 1).all()
    row = 200  # in the second document: its keys from 96 on, of which block 6 (192-223) is kept
    scores = torch.softmax(q[row, 0] @ k[96 : row + 1, 0].T / 4.0, dim=-1)
    assert recall[0, row] == pytest.approx(float(scores[192 - 96 :].sum()), rel=1e-5)


def test_a_model_built_with_it_runs_the_dense_and_sparse_passes():
    torch.manual_seed(0)
    model = ModelConfig(preset="demo", overrides=TINY).build(IMPLEMENTATION).eval()
    rng = np.random.default_rng(0)
    streams = pack_streams([rng.integers(0, 512, n) for n in (200, 150, 100)], 256, 1, seed=0)
    dense = list(dense_losses(model, streams, 64))
    keep_all = SelectionVariant.parse("all:max_density=1.0")
    per_stream = list(sparse_pass(model, streams, keep_all, 1.0, 64))
    assert [s["tokens"] for s in per_stream] == [tokens for _, tokens in dense]
    summary = summarise(keep_all, per_stream, dense, num_layers=2)
    assert summary["exact_recall"] == pytest.approx(1.0, abs=1e-5) and summary["density"] == pytest.approx(1.0)
    assert summary["loss"] == pytest.approx(summary["dense_loss"], rel=1e-4) and len(summary["layers"]) == 2
    sparse = summarise(keep_all, list(sparse_pass(model, streams, keep_all, 0.3, 64)), dense, num_layers=2)
    assert sparse["density"] < 1.0 and sparse["exact_recall"] < 1.0
