"""Corpus building, packing and the per-rank batch plan."""

import json
import logging
import multiprocessing
import subprocess
import sys
from collections import Counter

import lightning as L
import numpy as np
import pytest
import torch

from sparsebalance_pl.datamodules.builder import FolderSource, SyntheticSource, build_splits, load_lengths
from sparsebalance_pl.datamodules import BatchingConfig, CorpusConfig, LongContextDataModule, PlanItems
from sparsebalance_pl.datamodules.packing import collate_packed, first_fit
from sparsebalance_pl.datamodules.planner import PlannerConfig
from sparsebalance_pl.datamodules.sampler import (
    PaddingItem,
    PlannedBatchSampler,
    first_fit_plan,
    plan_efficiency,
    sparsity_aware_plan,
)
from sparsebalance_pl.datamodules.synthetic import LengthPrior, synthetic_document
from sparsebalance_pl.datamodules.tokenizer import ByteTokenizer
from sparsebalance_pl.attention import AttentionConfig
from sparsebalance_pl.callbacks import DensityCalibration
from sparsebalance_pl.errors import DataError
from sparsebalance_pl.model import ModelConfig
from sparsebalance_pl.module import SparseCausalLM


def test_length_prior_is_scaled_to_the_maximum():
    rng = np.random.default_rng(0)
    lengths = LengthPrior.load("wlbllm").sample(20000, rng, max_tokens=4096)
    assert lengths.max() == 4096 and lengths.min() >= 32
    assert 0.005 < np.mean(lengths == 4096) < 0.03  # the top ~1% is clipped at the maximum
    assert np.median(lengths) < 0.25 * 4096  # heavy tail: most documents are short


def test_synthetic_document_plants_retrievable_needles():
    doc = synthetic_document(np.random.default_rng(3), 3000)
    assert abs(len(doc) - 3000) < 200
    key = doc.split("The pass key is ")[1][:5]
    assert doc.rstrip().count(key) >= 3  # planted twice, answered once at the end
    assert "What is the value of key" in doc


def test_collate_packs_without_crossing_documents():
    docs = [np.array([1, 2, 3]), np.array([4, 5]), np.array([6, 7, 8, 9])]
    batch = collate_packed([{"tokens": d} for d in docs])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert batch["targets"].tolist() == [[2, 3, -100, 5, -100, 7, 8, 9, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 5, 9] and batch["cu_seqlens"].dtype == torch.int32


def test_first_fit_respects_capacity_and_uses_every_document():
    lengths = np.random.default_rng(0).integers(1, 100, 500)
    batches = first_fit(lengths, np.arange(500), max_tokens=128)
    assert sorted(i for b in batches for i in b) == list(range(500))
    assert max(lengths[b].sum() for b in batches) <= 128
    with pytest.raises(ValueError, match="max_tokens"):
        first_fit(np.array([200]), np.arange(1), max_tokens=128)


def _first_fit(lengths, epoch, num_ranks=3, shuffle=True):
    return first_fit_plan(lengths, lengths, max_tokens=2048, num_ranks=num_ranks, seed=5, epoch=epoch, shuffle=shuffle)


def _sab(lengths, epoch, num_ranks=3, cost=lambda n: 2000 * n + n**2, defer_window=8):
    config = PlannerConfig(world_size=num_ranks, tokens_per_rank=2048, seed=5, defer_window=defer_window)
    return sparsity_aware_plan(lengths, cost, config, epoch)


@pytest.mark.parametrize("plan_fn", [_first_fit, _sab])
def test_plan_is_identical_on_every_rank_and_equal_in_length(plan_fn):
    lengths = np.random.default_rng(1).integers(10, 1000, 400)
    samplers = [PlannedBatchSampler(lambda e: plan_fn(lengths, e), rank=r) for r in range(3)]
    per_rank = [list(s) for s in samplers]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == len(samplers[0])
    seen = [i for p in per_rank for b in p for i in b if not isinstance(i, PaddingItem)]
    assert len(seen) == len(set(seen))
    assert all(lengths[[i for i in b if not isinstance(i, PaddingItem)]].sum() <= 2048 for p in per_rank for b in p)
    samplers[0].set_epoch(1)
    assert list(samplers[0]) != per_rank[0]


def _used(plan) -> list[int]:
    items = (i for step in plan for rank in step.micro_batches for mb in rank for i in mb)
    return sorted(i for i in items if not isinstance(i, PaddingItem))


def test_both_planners_use_every_document_once_and_sab_balances_predicted_time():
    """The baseline pads its incomplete last step rather than drop it: compared planners do the same work."""
    lengths = LengthPrior.load("wlbllm").sample(1000, np.random.default_rng(2), 2048)
    sab = _sab(lengths, 0)
    costs = 2000.0 * lengths + lengths.astype(float) ** 2
    baseline = first_fit_plan(lengths, costs, max_tokens=2048, num_ranks=3, seed=5, epoch=0, shuffle=True)
    on_four = first_fit_plan(lengths, costs, max_tokens=2048, num_ranks=4, seed=5, epoch=0, shuffle=True)
    assert _used(sab) == _used(baseline) == _used(on_four) == list(range(1000))
    assert isinstance(on_four[-1].micro_batches[-1][0][0], PaddingItem)  # 135 micro-batches: the last step padded
    assert plan_efficiency(sab) > plan_efficiency(baseline) + 0.03


def test_resumed_sampler_skips_exactly_what_was_consumed():
    lengths = np.random.default_rng(3).integers(10, 1000, 300)
    full = list(PlannedBatchSampler(lambda e: _sab(lengths, e), rank=1, epoch=2))
    resumed = PlannedBatchSampler(lambda e: _sab(lengths, e), rank=1, epoch=2, skip=7)
    assert list(resumed) == full[7:]
    assert list(resumed) == full  # later passes start at the beginning again


def test_a_resume_after_an_epochs_last_step_skips_nothing_of_the_next_epoch():
    """A checkpoint saved after the last step of epoch 2 resumes with all of epoch 2 consumed; Lightning then
    names epoch 3, which must run whole (the skip once carried into it: a silently skipped epoch)."""
    lengths = np.random.default_rng(3).integers(10, 1000, 300)
    consumed = len(PlannedBatchSampler(lambda e: _sab(lengths, e), rank=1, epoch=2))
    resumed = PlannedBatchSampler(lambda e: _sab(lengths, e), rank=1, epoch=2, skip=consumed)
    resumed.set_epoch(3)
    assert list(resumed) == list(PlannedBatchSampler(lambda e: _sab(lengths, e), rank=1, epoch=3))


def test_synthetic_dataset_round_trip(tmp_path):
    start_method = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("forkserver", force=True)
    try:
        build_splits(
            str(tmp_path),
            SyntheticSource(num_documents=40, seed=1),
            tokenizer_spec="byte",
            max_doc_tokens=512,
            val_fraction=0.1,
        )
        assert multiprocessing.get_start_method() == "forkserver"  # litdata sets spawn for the process
    finally:
        multiprocessing.set_start_method(start_method, force=True)
    lengths = load_lengths(tmp_path / "train")
    import litdata

    view = PlanItems(litdata.StreamingDataset(str(tmp_path / "train")), len(lengths))
    assert len(lengths) + len(load_lengths(tmp_path / "val")) == 40
    for i in (0, len(lengths) - 1):
        sample = view[i]
        assert sample["length"] == lengths[i] == len(sample["tokens"]) <= 512
        assert sample["tokens"][-1] == ByteTokenizer.eos_id
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "synthetic"


def test_the_builder_imports_without_lightning():
    # litdata spawns its build workers, which import the builder's module to unpickle the sample function: with
    # Lightning on that path every worker paid 7-15 s of imports each time a corpus was built
    probe = "import sys, sparsebalance_pl.datamodules.builder; print('lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_every_exported_name_is_what_its_module_defines():
    # a name loaded on first use must not be shadowed by the submodule of the same name (``partition``)
    import importlib

    import sparsebalance_pl.datamodules as package

    importlib.import_module("sparsebalance_pl.datamodules.partition")
    for name in package.__all__:
        value = getattr(package, name)
        assert not isinstance(value, type(package)), name
        assert value is getattr(importlib.import_module(value.__module__), name), name


def test_folder_source_splits_long_documents_and_survives_bad_text(tmp_path, capfd):
    # litdata encodes in worker processes: their warnings reach stderr, not the logging capture
    text_dir = tmp_path / "text"
    text_dir.mkdir()
    (text_dir / "a.txt").write_text("x" * 1000)
    (text_dir / "b.jsonl").write_text(json.dumps({"text": "hello"}) + "\nnot json\n" + json.dumps({"t": 1}) + "\n")
    (text_dir / "c.txt").write_bytes(b"caf\xe9 latin-1 text")
    out = tmp_path / "data"
    build_splits(str(out), FolderSource.scan(str(text_dir)), tokenizer_spec="byte", max_doc_tokens=300,
                 val_fraction=0.0)
    lengths = sorted(load_lengths(out / "train").tolist())
    assert lengths == sorted([300, 300, 300, 101, 6, 20])  # 1001 tokens in 4 pieces; hello+eos; c.txt (U+FFFD is 3 bytes)+eos
    err = capfd.readouterr().err
    assert "b.jsonl:2" in err and "b.jsonl:3" in err and "c.txt: not valid UTF-8" in err


def test_missing_and_empty_folders_are_reported(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        FolderSource.scan(str(tmp_path / "nope"))
    with pytest.raises(DataError, match="holds no"):
        FolderSource.scan(str(tmp_path))


def test_datamodule_serves_packed_batches(tmp_path):
    dm = LongContextDataModule(CorpusConfig(data_dir=str(tmp_path), num_documents=60, max_doc_tokens=256,
                                            val_fraction=0.1), BatchingConfig(max_tokens=512))
    dm.prepare_data()
    batches = list(dm.train_dataloader())
    assert batches and all(b["input_ids"].shape[1] <= 512 for b in batches)
    assert all(int(b["cu_seqlens"][-1]) == b["input_ids"].shape[1] for b in batches)


def test_tokenizers():
    from sparsebalance_pl.datamodules.tokenizer import load_tokenizer
    from sparsebalance_pl.errors import ConfigError

    byte = load_tokenizer("byte")
    assert byte.decode(byte.encode("héllo")) == "héllo"
    qwen = load_tokenizer("qwen-tiktoken")
    ids = qwen.encode("Hello world")
    assert ids == [9707, 1879]  # Qwen2's BPE ids for "Hello" and " world"
    assert qwen.decode(ids + [qwen.eos_id]) == "Hello world"
    with pytest.raises(ConfigError, match="data.corpus.tokenizer"):
        load_tokenizer("/no/such/tokenizer")


def test_evaluation_plan_pads_instead_of_dropping():
    lengths = np.array([100, 100, 100, 30])
    plan = first_fit_plan(lengths, lengths, max_tokens=100, num_ranks=3, seed=0, epoch=0, shuffle=False)
    assert [len(step.micro_batches) for step in plan] == [3, 3]
    assert plan[1].micro_batches[1:] == [[[PaddingItem(3)]], [[PaddingItem(3)]]]
    real = sorted(i for step in plan for r in step.micro_batches for mb in r for i in mb if not isinstance(i, PaddingItem))
    assert real == [0, 1, 2, 3]
    batch = collate_packed([{"tokens": np.arange(5), "bears_loss": False}, {"tokens": np.arange(3)}])
    assert batch["targets"].tolist() == [[-100] * 5 + [1, 2, -100]]


def test_eval_tasks_hold_their_answers_at_the_end():
    from sparsebalance_pl.datamodules.eval_tasks import EvalConfig, make_eval_samples
    from sparsebalance_pl.datamodules.packing import collate_answers

    config = EvalConfig(lengths=(256, 512), samples_per_cell=2)
    samples = make_eval_samples(config, ByteTokenizer())
    assert len(samples) == 3 * 2 * 2 and [s["cell"] for s in samples[:4]] == [0, 0, 1, 1]
    tok = ByteTokenizer()
    for s in samples:
        assert len(s["tokens"]) <= s["length"]
        answer = tok.decode(s["tokens"][s["answer_start"]:].tolist()).strip(" .")
        context = tok.decode(s["tokens"][: s["answer_start"]].tolist())
        haystack_part, question = context.rsplit("?", 1)
        assert answer in haystack_part and answer not in question  # planted in the context, not given away
    assert config.cells[:2] == ["passkey@256", "passkey@512"]
    batch = collate_answers([samples[0], {**samples[1], "bears_loss": False}, samples[5]])
    first_end = len(samples[0]["tokens"])
    assert batch["answer_spans"][0].tolist() == [samples[0]["answer_start"], first_end]
    assert batch["cells"].tolist() == [0, 2] and batch["answer_spans"].shape == (2, 2)


def test_changed_folder_is_reported_and_rebuilt(tmp_path, caplog):
    text_dir = tmp_path / "text"
    text_dir.mkdir()
    (text_dir / "a.txt").write_text("first document " * 20)
    (text_dir / "b.txt").write_text("second document " * 20)
    out = str(tmp_path / "data")
    build = lambda: build_splits(out, FolderSource.scan(str(text_dir)), tokenizer_spec="byte",  # noqa: E731
                                 max_doc_tokens=256, val_fraction=0.0)
    build()
    (text_dir / "b.txt").write_text("changed " * 30)
    (text_dir / "c.txt").write_text("new " * 30)
    build()
    assert "modified:" in caplog.text and "b.txt" in caplog.text and "added:" in caplog.text
    assert len(load_lengths(tmp_path / "data" / "train")) == 4  # a.txt (2 pieces), b.txt, c.txt: nothing lost


def test_empty_and_oversize_documents_are_reported(tmp_path, capfd):
    text_dir = tmp_path / "text"
    text_dir.mkdir()
    (text_dir / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ["ok", "", "y" * 600]) + "\n")
    build_splits(str(tmp_path / "data"), FolderSource.scan(str(text_dir)), tokenizer_spec="byte",
                 max_doc_tokens=256, val_fraction=0.0, oversize="reject")
    err = capfd.readouterr().err
    assert "docs.jsonl:2: empty document skipped" in err
    assert "docs.jsonl:3: document of 601 tokens rejected" in err
    assert load_lengths(tmp_path / "data" / "train").tolist() == [3]


def test_truncated_chunk_is_named(tmp_path):
    build_splits(str(tmp_path), SyntheticSource(num_documents=10, seed=1), tokenizer_spec="byte",
                 max_doc_tokens=256, val_fraction=0.0)
    chunk = next((tmp_path / "train").glob("chunk-*.bin"))
    chunk.write_bytes(chunk.read_bytes()[:100])
    with pytest.raises(DataError, match=f"{chunk.name}.*truncated or corrupt"):
        load_lengths(tmp_path / "train")


def test_fresh_fit_calibrates_the_density_estimate_before_the_first_plan(tmp_path, caplog):
    dm = LongContextDataModule(CorpusConfig(data_dir=str(tmp_path / "data"), num_documents=80, max_doc_tokens=512,
                                            val_fraction=0.0), BatchingConfig(method="sab", max_tokens=1024))
    dm.prepare_data()
    batches = dm.calibration_batches(min_length=16, per_bin=2)
    lengths = [n for b in batches for n in torch.diff(b["cu_seqlens"]).tolist()]
    assert all(b["input_ids"].shape[1] <= 1024 for b in batches) and min(lengths) >= 16
    train = dm.lengths("train")
    available = Counter(np.floor(2 * np.log2(train[train >= 16])).astype(int).tolist())  # half-octaves
    assert Counter(np.floor(2 * np.log2(lengths)).astype(int).tolist()) == {b: min(2, c) for b, c in available.items()}

    torch.manual_seed(0)
    module = SparseCausalLM(model=ModelConfig(preset="demo", overrides={"num_layers": 2, "hidden_size": 64}),
                        attention=AttentionConfig(backend="sparse", block_size=16, stride=4, tau=0.9))
    cost_model = module.sparse_attention.cost_model
    dm.connect(cost_model)
    prior_costs = cost_model.document_costs(dm.lengths("train"))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
                        callbacks=[DensityCalibration()])
    with caplog.at_level(logging.INFO):
        trainer.fit(module, datamodule=dm)
    assert cost_model.density.observed and f"calibrated on {len(lengths)} documents" in caplog.text
    epoch, planned = dm.train_sampler.plan_costs
    assert epoch == 0 and not np.allclose(planned, prior_costs)
