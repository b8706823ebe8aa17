"""The logic of benchmarks/sparse_finetune.py (arguments, fine-tune commands, held-out check, gap table) on
small synthetic inputs: no model, no data folder, no training."""

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from main_runner import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import sparse_finetune as sf  # noqa: E402


def test_defaults_and_bad_arguments_end_with_one_line():
    args = sf.parse_args(["--out", "x"])
    assert (args.length, args.tau, args.devices, args.activation_checkpointing) == (4096, 0.9, 1, False)
    for bad, message in [(["--steps", "0"], "--steps=0 must be at least 1"),
                         (["--lr", "0"], "--lr=0.0 must be positive"),
                         (["--steps", "4", "--warmup-steps", "4"], "--warmup-steps=4 must lie in"),
                         (["--tau", "1.5"], "--tau and --iso-taus must lie in (0, 1]"),
                         (["--iso-taus", "0.8", "0"], "--tau and --iso-taus must lie in (0, 1]"),
                         (["--length", "1000"], "--length=1000 must be a positive multiple of --block-size=64"),
                         (["--streams", "0"], "--streams, --devices and --threads must be at least 1"),
                         (["--ngram", "1"], "--ngram=1 must be at least 2"),
                         (["--max-shared", "2"], "--max-shared=2.0 must lie in [0, 1]")]:
        with pytest.raises(SystemExit, match=re.escape("error: " + message)):
            sf.parse_args(["--out", "x", *bad])


def test_missing_inputs_are_named(tmp_path):
    args = sf.parse_args(["--out", "x", "--model", str(tmp_path)])
    with pytest.raises(SystemExit, match="--model has no config.json"):
        sf.check_paths(args)


def test_the_two_fine_tunes_differ_only_in_backend_and_folder(tmp_path):
    args = sf.parse_args(["--out", str(tmp_path), "--steps", "7", "--lr", "5e-5"])
    dense, sparse = (sf.cli_args(args, tmp_path, b) for b in sf.BACKENDS)
    differ = [(d, s) for d, s in zip(dense, sparse) if d != s]
    assert differ == [(str(tmp_path / "dense" / "overlay.yaml"), str(tmp_path / "sparse" / "overlay.yaml")),
                      ("--model.attention.backend=dense", "--model.attention.backend=sparse")]
    for expected in ("--trainer.max_steps=7", "--model.optim.lr=5e-05", "--data.batching.method=first_fit",
                     "--data.batching.max_tokens=4096", "--data.corpus.max_doc_tokens=4096",
                     f"--data.corpus.data_dir={tmp_path / 'corpus-4096'}", "--model.attention.tau=0.9"):
        assert expected in dense
    layer = yaml.safe_load(yaml.safe_dump(sf.overlay(tmp_path / "dense")))["trainer"]
    callbacks = [c["class_path"].rsplit(".", 1)[1] for c in layer["callbacks"]]
    assert callbacks == ["LearningRateMonitor", "ModelCheckpoint"]  # no DST, no density calibration
    assert layer["limit_val_batches"] == 0


def test_window_hashes_match_equal_windows_only():
    doc = np.array([1, 2, 3, 1, 2, 3, 4])
    hashes = sf.window_hashes(doc, 3)
    assert len(hashes) == 5 and hashes[0] == hashes[3] and len(set(hashes.tolist())) == 4
    assert len(sf.window_hashes(np.array([1, 2]), 3)) == 0


def test_shared_windows_counts_training_text_in_evaluation_documents():
    rng = np.random.default_rng(0)
    train = [rng.integers(0, 1000, 50), rng.integers(0, 1000, 3)]
    fresh = rng.integers(1000, 2000, 20)
    copied = np.concatenate([train[0][10:20], rng.integers(1000, 2000, 10)])  # 10 tokens from training
    result = sf.shared_windows([fresh, copied], sf.training_windows(train, 4), 4)
    assert result["eval_windows"] == 17 + 17
    assert result["shared_windows"] == 7  # the windows inside the copied 10 tokens
    assert result["documents_with_shared_windows"] == 1
    assert result["max_document_share"] == pytest.approx(7 / 17)
    assert sf.window_share(copied, sf.training_windows([], 4), 4) == (17, 0)


def test_stream_documents_cuts_streams_at_document_bounds():
    import torch

    stream = {"input_ids": torch.arange(6), "cu_seqlens": torch.tensor([0, 2, 6], dtype=torch.int32)}
    pieces = sf.stream_documents([stream])
    assert [p.tolist() for p in pieces] == [[0, 1], [2, 3, 4, 5]]


def _manifest(files, kind="installed"):
    return {"source": {"kind": kind, "files": {f: "1:1" for f in files}}, "val_fraction": 0.25,
            "tokenizer": "byte", "max_doc_tokens": 64, "oversize": "split"}


def test_split_files_reproduces_the_builders_split_and_overlap_is_found(tmp_path):
    from sparsebalance_pl.datamodules.builder import _split

    files = []
    for i in range(12):
        path = tmp_path / f"f{i}.txt"
        path.write_text(f"document {i}")
        files.append(str(path))
    train, val = sf.split_files(_manifest(files))
    assert (train, val) == _split(files, 0.25, 0) and val and not set(train) & set(val)
    assert sf.file_overlap(val, train) == {"eval_files": len(val), "train_files": len(train), "shared_paths": [],
                                           "shared_contents": 0}
    twin = tmp_path / "twin.txt"
    twin.write_text(Path(val[0]).read_text())  # another path, the same content
    overlap = sf.file_overlap(val, [*train, str(twin), val[0]])
    assert overlap["shared_paths"] == [val[0]] and overlap["shared_contents"] == 1
    with pytest.raises(SystemExit, match="a synthetic corpus has no files"):
        sf.split_files(_manifest(files, kind="synthetic"))


def _evaluation(dense, sparse, iso=()):
    return {"dense_streams": dense, "dense_loss": sf._mean_loss(dense), "sparse_streams": sparse, "tau": 0.9,
            "sparse_loss": sf._mean_loss(sparse), "density": 0.3, "exact_recall": 0.85, "estimated_recall": 0.9,
            "iso": [{"tau": tau, "density": density, "sparse_loss": loss, "exact_recall": 0.8}
                    for tau, density, loss in iso]}


def test_gap_before_and_after_and_the_tables():
    base = _evaluation([(20.0, 10), (30.0, 10)], [(22.0, 10), (33.0, 10)])  # dense 2.5, sparse 2.75: +10%
    dense_ft = _evaluation([(18.0, 10), (27.0, 10)], [(19.5, 10), (29.0, 10)])  # dense 2.25, sparse 2.425
    sparse_ft = _evaluation([(18.5, 10), (28.0, 10)], [(19.0, 10), (28.5, 10)])  # own dense 2.325, sparse 2.375
    rows, summary = sf.table_rows(base, dense_ft, sparse_ft)
    assert [r["model"] for r in rows] == ["base", "dense-ft", "sparse-ft"]
    assert summary["before"] == pytest.approx(0.1)
    assert summary["after"] == pytest.approx(2.375 / 2.25 - 1)
    assert summary["dense_ft_own"] == pytest.approx(2.425 / 2.25 - 1)
    assert summary["sparse_ft_own"] == pytest.approx(2.375 / 2.325 - 1)
    assert summary["closed_share"] == pytest.approx(1 - (2.375 / 2.25 - 1) / 0.1)
    assert summary["before_per_stream"] == pytest.approx([0.1, 0.1])
    assert summary["after_per_stream"] == pytest.approx([1.9 / 1.8 - 1, 2.85 / 2.7 - 1])
    assert summary["streams_with_smaller_gap"] == 2
    assert rows[1]["gap_vs_reference"] == rows[1]["gap_vs_own_dense"] == summary["dense_ft_own"]
    lines = sf.markdown(rows, summary, 0.9).splitlines()
    assert lines[2] == "| base | - | 2.5000 | 2.7500 | +10.00% | +10.00% | 0.300 | 0.850 | 0.900 |"
    assert lines[3] == "| dense-ft | dense | 2.2500 | 2.4250 | +7.78% | +7.78% | 0.300 | 0.850 | 0.900 |"
    assert lines[4].startswith("| sparse-ft | sparse | 2.3250 | 2.3750 | +5.56% | +2.15% |")
    assert "(44% of the gap closed); smaller on 2 of 2 streams." in lines[-1]
    assert lines[-1].endswith("leaves the dense-ft model a gap of +7.78% of its own.")
    assert summary["iso_after"] is None and summary["iso_dense_ft_own"] is None  # no other taus scored
    runs = {"dense": {"train_loss": [2.0, 1.5]}, "sparse": {"train_loss": [2.2, 1.5], "density": [0.3, 0.25]}}
    assert sf.training_table(runs).splitlines()[2:] == ["| 1 | 2.0000 | 2.2000 | +10.00% | 0.300 |",
                                                        "| 2 | 1.5000 | 1.5000 | +0.00% | 0.250 |"]


def test_losses_at_the_base_density_are_interpolated_between_taus():
    base = _evaluation([(25.0, 10)], [(27.5, 10)])  # density 0.3, dense 2.5, sparse 2.75
    dense_ft = _evaluation([(20.0, 10)], [(22.0, 10)], iso=[(0.85, 0.25, 2.4)])  # dense 2.0, sparse 2.2 at 0.3
    sparse_ft = _evaluation([(20.5, 10)], [(21.0, 10)], iso=[(0.85, 0.2, 2.3)])
    sparse_ft["density"] = 0.4  # tau 0.9 keeps more after sparse training: 0.3 lies between 0.2 and 0.4
    assert sf.iso_density(sparse_ft, 0.3) == pytest.approx(2.2)
    assert sf.iso_density(sparse_ft, 0.5) is None
    assert sf.iso_density(dense_ft, 0.3) == pytest.approx(2.2)  # a tau's own density: its loss
    rows, summary = sf.table_rows(base, dense_ft, sparse_ft)
    assert summary["iso_after"] == pytest.approx(0.1) and summary["iso_dense_ft_own"] == pytest.approx(0.1)
    text = sf.iso_table({"base": base, "dense-ft": dense_ft, "sparse-ft": sparse_ft}, summary).splitlines()
    assert text[2:4] == ["| base | 0.9 | 0.300 | 0.850 | 2.7500 | +10.00% |",
                         "| dense-ft | 0.85 | 0.250 | 0.800 | 2.4000 | +20.00% |"]
    assert text[-1] == ("At the base model's density 0.300 (interpolated between taus): sparse-ft vs dense-ft dense "
                        "+10.00%, dense-ft's own gap +10.00%; before +10.00%.")


def test_phases_are_reused_only_with_the_same_settings(tmp_path):
    path = tmp_path / "results.json"
    calls = []
    first = sf.Phases(path, resume=True)  # nothing to resume yet
    assert first.run("a", {"x": 1}, lambda: calls.append(1) or {"v": 1}) == {"v": 1}
    again = sf.Phases(path, resume=True)
    assert again.run("a", {"x": 1}, lambda: calls.append(2) or {"v": 2}) == {"v": 1}
    assert again.run("a", {"x": 2}, lambda: calls.append(3) or {"v": 3}) == {"v": 3}
    fresh = sf.Phases(path, resume=False)
    assert fresh.run("a", {"x": 2}, lambda: calls.append(4) or {"v": 4}) == {"v": 4}
    assert calls == [1, 3, 4]
