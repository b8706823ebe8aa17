"""The compared variants and their ``NAME:key=value,...`` specs: AttentionConfig fields (model_step's), DST
settings of a tuning variant, and the settings a comparison checks before anything runs."""

import pytest
import torch

from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.variants import (
    ComparisonSettings, attempt, attention_variant, merged_configs, parse_variant, run_folder, variant_config,
    variant_kind,
)


def test_a_spec_parses_numbers_and_booleans_and_keeps_the_rest_as_text():
    assert parse_variant("v:a=3,b=0.5,c=True,d=sampled", "--x") == ("v", {"a": 3, "b": 0.5, "c": True, "d": "sampled"})
    assert parse_variant("plain", "--x") == ("plain", {})
    with pytest.raises(ConfigError, match="--x 'v:a': 'a' is not field=value"):
        parse_variant("v:a", "--x")


def test_a_variant_that_fails_is_named_with_its_reason_in_one_line():
    failed = {}
    assert attempt("fine", failed, pow, 2, 3) == 8

    def raising(error: BaseException):
        raise error

    assert attempt("broken", failed, raising, RuntimeError("CUDA out of memory.\nTried to allocate 2 GiB")) is None
    assert failed == {"broken": "RuntimeError: CUDA out of memory."}
    for stop in KeyboardInterrupt(), torch.AcceleratorError("an illegal memory access"):  # no variant's own failure
        with pytest.raises(type(stop)):
            attempt("stopped", failed, raising, stop)
    assert list(failed) == ["broken"]


def test_an_attention_variant_sets_the_named_fields():
    name, config = attention_variant("quality:block_size=32,estimate=sampled,recall_probes=1,tau=0.85")
    assert name == "quality" and (config.block_size, config.estimate, config.recall_probes) == (32, "sampled", 1)
    assert config.tau == 0.85 and config.backend == "sparse"
    assert attention_variant("windowed:per_head_tau=false")[1].per_head_tau is False


@pytest.mark.parametrize("spec, message", [("a:tau", "is not field=value"), ("a:blok=3", "blok"),
                                           ("a:block_size=48", "power of two")])
def test_a_bad_attention_variant_is_one_line_naming_it(spec, message):
    with pytest.raises(ConfigError, match=message) as err:
        attention_variant(spec)
    assert "\n" not in str(err.value) and spec in str(err.value)


def test_a_variant_takes_its_own_dst_settings_over_the_comparisons(tmp_path):
    settings = ComparisonSettings(configs=["c.yaml"], out=tmp_path, ranks=4, anchor="median", variants=[
        "static", "sparsebalance", "sparsebalance:anchor=adaptive,recall_tolerance=0.001"])
    assert settings.dst("static")["p"] == 0.0 and settings.dst("sparsebalance")["anchor"] == "median"
    assert settings.dst("sparsebalance:anchor=adaptive,recall_tolerance=0.001") == {
        "anchor": "adaptive", "p": 0.1, "recall_tolerance": 0.001}
    folders = {run_folder(settings.out, spec, 0) for spec in settings.variants}
    assert len(folders) == 3 and all(":" not in f.name and "," not in f.name for f in folders)
    assert variant_kind("sparsebalance:anchor=adaptive") == "sparsebalance"


@pytest.mark.parametrize("source, size, folder", [
    ("synthetic", "num_documents", "data/e2e_40_2048"), ("installed", "max_files", "data/e2e_installed_40_2048")])
def test_an_epoch_of_k_documents_sizes_the_corpus_by_its_kind(source, size, folder, tmp_path):
    """A synthetic corpus makes K documents; a real-text one takes K files (a long file splits into several)."""
    settings = ComparisonSettings(configs=[], variants=["static"], out=tmp_path, ranks=4, epoch_documents=40,
                                  max_tokens=2048)
    base = {"trainer": {}, "model": {"attention": {}, "model": {"preset": "demo"}},
            "data": {"corpus": {"source": source, "data_dir": "data/x"}, "batching": {}}}
    config = variant_config(base, "static", settings, tmp_path)
    corpus = config["data"]["corpus"]
    assert corpus[size] == 40 and corpus["data_dir"] == folder and corpus["max_doc_tokens"] == 2048
    assert ({"num_documents", "max_files"} - {size}).isdisjoint(corpus)
    assert config["data"]["batching"]["method"] == "first_fit" and config["trainer"]["max_epochs"] == 1
    assert config["trainer"]["callbacks"][1]["init_args"]["p"] == 0.0  # static: DST only measures
    assert base["trainer"] == {}  # the base configuration is left as it was


@pytest.mark.parametrize("changes, message", [
    ({"variants": ["static:anchor=min"]}, "static does not tune"),
    ({"variants": ["dst:anchr=min"]}, "unknown setting 'anchr'"),
    ({"variants": ["balanced"]}, "unknown variant 'balanced'"),
    ({"variants": ["dst:p=2"]}, r"p=2.0 must lie in \[0, 1\]"),
    ({"variants": ["sab", "sab"]}, "names a variant twice"),
    ({"variants": ["dst:p"]}, "is not field=value"),
    ({"ranks": None, "repeats": 3}, "--repeats 3 needs --ranks"),
    ({"ranks": None, "frozen": True}, "--frozen needs --ranks"),
    ({"ranks": None, "calibrate_steps": 2}, "--calibrate-steps 2 needs --ranks"),
    ({"ranks": 0}, "--ranks 0 must be at least 1"),
    ({"steps": 5, "warmup": 5}, "--steps 5 leaves no step after --warmup 5"),
])
def test_settings_that_cannot_run_are_one_line(changes, message, tmp_path):
    with pytest.raises(ConfigError, match=message) as err:
        ComparisonSettings(**{"configs": [], "variants": ["static"], "out": tmp_path, "ranks": 4, **changes})
    assert "\n" not in str(err.value)


def test_configuration_files_stack_in_order(tmp_path):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("model:\n  optim: {lr: 0.1, warmup_steps: 3}\ntrainer: {max_steps: 5}\n")
    second.write_text("model:\n  optim: {lr: 0.2}\n")
    assert merged_configs([first, second]) == {"model": {"optim": {"lr": 0.2, "warmup_steps": 3}},
                                               "trainer": {"max_steps": 5}}
