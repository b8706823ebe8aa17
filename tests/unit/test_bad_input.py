"""Bad input the other tests leave out: split documents are reported, a chunk with a damaged header is named
before training reads it (a 2-rank run stopped by one: tests/multiprocess/test_damaged_data.py), damaged token
contents are named with their sample, and the settings that are only checked against each other, against the
trainer or by a callback stop the run with one line naming them."""

import json

import pytest
from data_damage import damage_chunk_header as _damage_header
from main_runner import REPO
from main_runner import error_of as _error_of

from sparsebalance_pl.datamodules.builder import FolderSource, SyntheticSource, build_splits, load_lengths
from sparsebalance_pl.datamodules.datamodule import PlanItems
from sparsebalance_pl.datamodules.tokenizer import ByteTokenizer
from sparsebalance_pl.errors import DataError


def test_split_documents_are_reported_and_no_token_is_lost(tmp_path, capfd):
    # litdata encodes in worker processes: their warnings reach stderr, not the logging capture
    text_dir = tmp_path / "text"
    text_dir.mkdir()
    (text_dir / "long.txt").write_text("x" * 700)
    (text_dir / "short.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    build_splits(str(tmp_path / "data"), FolderSource.scan(str(text_dir)), tokenizer_spec="byte",
                 max_doc_tokens=300, val_fraction=0.0)
    err = capfd.readouterr().err
    assert "long.txt: document of 701 tokens split (data.corpus.max_doc_tokens=300, data.corpus.oversize=split)" in err
    assert sorted(load_lengths(tmp_path / "data" / "train").tolist()) == [6, 101, 300, 300]  # 701 tokens, and hello


def test_chunk_with_a_damaged_header_is_named(tmp_path):
    build_splits(str(tmp_path), SyntheticSource(num_documents=10, seed=1), tokenizer_spec="byte",
                 max_doc_tokens=256, val_fraction=0.0)
    lengths = load_lengths(tmp_path / "train")
    name = _damage_header(tmp_path / "train")
    with pytest.raises(DataError, match=f"{name}: chunk header's item offsets do not fit the file"):
        load_lengths(tmp_path / "train")
    assert lengths.size == 10


def test_tokens_outside_the_vocabulary_are_named_with_their_sample(tmp_path):
    import litdata

    build_splits(str(tmp_path), SyntheticSource(num_documents=10, seed=1), tokenizer_spec="byte",
                 max_doc_tokens=256, val_fraction=0.0)
    split = tmp_path / "train"
    lengths = load_lengths(split)
    chunk = max(split.glob("chunk-*.bin"))
    data = bytearray(chunk.read_bytes())
    data[-16:-8] = b"\x7f" * 8  # inside the last sample's tokens: the chunk still parses
    chunk.write_bytes(bytes(data))
    items = PlanItems(litdata.StreamingDataset(str(split)), len(lengths), ByteTokenizer.vocab_size, split)
    assert len(items[0]["tokens"]) == lengths[0]  # the other samples stay readable
    with pytest.raises(DataError, match=rf"train: sample {len(lengths) - 1} holds token id \d+, outside .*\[0, 257\)"):
        items[len(lengths) - 1]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--data.batching.micro_batches=2"], ["data.batching.micro_batches=2", "trainer.accumulate_grad_batches=1"]),
        (["--trainer.use_distributed_sampler=true"], ["trainer.use_distributed_sampler", "false"]),
        (["--data.corpus.tokenizer=qwen-tiktoken"], ["data.corpus.tokenizer", "vocab_size"]),
        (["--data.corpus.max_doc_tokens=32768", "--data.batching.max_tokens=32768"],
         ["data.corpus.max_doc_tokens", "max_position_embeddings"]),
        (["--data.batching.tokens_per_rank=10"], ["data.batching.tokens_per_rank", "data.corpus.max_doc_tokens", "data.batching.max_tokens"]),
        (["--data.corpus.oversize=drop"], ["data.corpus.oversize", "split", "reject"]),
        (["--data.corpus.val_fraction=1"], ["data.corpus.val_fraction", "[0, 1)"]),
        (["--data.corpus.length_distribution=nope"], ["data.corpus.length_distribution", "wlbllm", "prolong"]),
        (["--model.optim.lr=-1"], ["optim.lr", "positive"]),
        (["--model.loss_chunk_tokens=0"], ["loss_chunk_tokens", "positive"]),
        (["--model.attention.stride=128"], ["attention.stride", "power of two", "attention.block_size"]),
        (["--model.attention.max_density=2"], ["attention.max_density", "(0, 1]"]),
        (["--trainer.strategy.init_args.timeout=10"], ["timeout", '"h:m:s"']),
    ],
)
def test_more_bad_settings_are_named(capsys, monkeypatch, args, expected):
    monkeypatch.chdir(REPO)
    err = _error_of(capsys, *args)
    for text in expected:
        assert text in err, err


@pytest.mark.parametrize(
    "init_args, expected",
    [({"p": 2.0}, "DynamicSparsityTuning.p=2.0 must lie in [0, 1]"),
     ({"recall_tolerance": -0.5}, "DynamicSparsityTuning.recall_tolerance=-0.5 must lie in [0, 1]")],
)
def test_bad_callback_settings_are_named(capsys, monkeypatch, tmp_path, init_args, expected):
    """Callbacks are built by the configuration parser, which wraps their errors in its own."""
    dst = {"class_path": "sparsebalance_pl.callbacks.DynamicSparsityTuning", "init_args": init_args}
    (tmp_path / "dst.yaml").write_text(json.dumps({"trainer": {"callbacks": [dst]}}))
    monkeypatch.chdir(REPO)
    assert expected in _error_of(capsys, "--config", str(tmp_path / "dst.yaml"))
