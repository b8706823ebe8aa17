"""The benchmarks' ``NAME:key=value,...`` variants: model_step's AttentionConfig fields, selection_quality's
selection settings and end_to_end's DST settings, from the command line."""

import re
import sys

import pytest
from main_runner import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import end_to_end  # noqa: E402
import model_step  # noqa: E402
import selection_quality  # noqa: E402


def test_an_attention_variant_sets_the_named_fields():
    name, config = model_step.attention_variant("quality:block_size=32,estimate=sampled,recall_probes=1,tau=0.85")
    assert name == "quality" and (config.block_size, config.estimate, config.recall_probes) == (32, "sampled", 1)
    assert config.tau == 0.85 and config.backend == "sparse"
    assert model_step.attention_variant("windowed:per_head_tau=false")[1].per_head_tau is False


@pytest.mark.parametrize("spec, message", [("a:tau", "is not field=value"), ("a:blok=3", "blok"),
                                           ("a:block_size=48", "power of two")])
def test_a_bad_attention_variant_stops_with_one_line(spec, message):
    with pytest.raises(SystemExit, match=message):
        model_step.attention_variant(spec)


def test_a_selection_variant_splits_ranking_options_from_budgets():
    variant = selection_quality.Variant.parse("late:estimate=sampled,stride=8,per_head_tau=false,tau=0.85,"
                                              "late_tau=0.9,late_from=3")
    assert variant.rank_kwargs == {"estimate": "sampled", "stride": 8, "per_head_tau": False}
    assert (variant.tau, variant.layer_tau(2, 0.5), variant.layer_tau(3, 0.5)) == (0.85, 0.85, 0.9)


@pytest.mark.parametrize("spec, message", [("a:stride", "is not field=value"), ("a:blok=3", "unknown key 'blok'"),
                                           ("a:late_tau=0.9", "go together"), ("a:per_head_tau=no", "true or false")])
def test_a_bad_selection_variant_stops_with_one_line(spec, message):
    with pytest.raises(SystemExit, match=message):
        selection_quality.Variant.parse(spec)


def test_an_end_to_end_variant_takes_its_own_dst_settings_over_the_command_line():
    args = end_to_end.parse_args(["--ranks", "4", "--anchor", "median", "--variants", "static", "sparsebalance",
                                  "sparsebalance:anchor=adaptive,recall_tolerance=0.001"])
    settings = args.dst_settings
    assert settings["static"]["p"] == 0.0 and settings["sparsebalance"]["anchor"] == "median"
    assert settings["sparsebalance:anchor=adaptive,recall_tolerance=0.001"] == {
        "anchor": "adaptive", "p": 0.1, "recall_tolerance": 0.001}
    folders = {end_to_end.run_folder(args.out, spec, 0) for spec in args.variants}
    assert len(folders) == 3 and all(":" not in f.name and "," not in f.name for f in folders)
    assert end_to_end.variant_kind("sparsebalance:anchor=adaptive") == "sparsebalance"


@pytest.mark.parametrize("source, size, folder", [
    ("synthetic", "num_documents", "data/e2e_40_2048"), ("installed", "max_files", "data/e2e_installed_40_2048")])
def test_an_epoch_of_k_documents_sizes_the_corpus_by_its_kind(source, size, folder, tmp_path):
    """A synthetic corpus makes K documents; a real-text one takes K files (a long file splits into several)."""
    args = end_to_end.parse_args(["--ranks", "4", "--epoch-documents", "40", "--max-tokens", "2048",
                                  "--variants", "static"])
    base = {"trainer": {}, "model": {"attention": {}, "model": {"preset": "demo"}},
            "data": {"corpus": {"source": source, "data_dir": "data/x"}, "batching": {}}}
    corpus = end_to_end.variant_config(base, "static", args, tmp_path)["data"]["corpus"]
    assert corpus[size] == 40 and corpus["data_dir"] == folder and corpus["max_doc_tokens"] == 2048
    assert ({"num_documents", "max_files"} - {size}).isdisjoint(corpus)


@pytest.mark.parametrize("variants, message", [
    (["static:anchor=min"], "static does not tune"), (["dst:anchr=min"], "unknown setting 'anchr'"),
    (["balanced"], "unknown variant 'balanced'"), (["dst:p=2"], r"p=2.0 must lie in \[0, 1\]"),
    (["sab", "sab"], "names a variant twice"), (["dst:p"], "is not field=value")])
def test_a_bad_end_to_end_variant_stops_with_one_line(variants, message, capsys):
    with pytest.raises(SystemExit):
        end_to_end.parse_args(["--ranks", "4", "--variants", *variants])
    assert re.search(message, capsys.readouterr().err.splitlines()[-1])
