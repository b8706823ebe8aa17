"""``data.corpus.source: installed``: real documents found on the machine (installed packages' source and
documentation, licence texts), chosen deterministically, each content once, built like a text folder."""

from pathlib import Path

import pytest
from main_runner import REPO
from main_runner import error_of as _error_of

from sparsebalance_pl.datamodules import BatchingConfig, CorpusConfig, LongContextDataModule
from sparsebalance_pl.datamodules.builder import (
    InstalledTextSource, default_real_text_roots, load_lengths, read_manifest, source_documents, source_file_splits,
)
from sparsebalance_pl.errors import DataError


def _tree(root, files: dict[str, bytes | str]):
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


@pytest.fixture
def roots(tmp_path):
    packages = _tree(tmp_path / "site-packages", {
        "pkg/__init__.py": "from .core import run\n",
        "pkg/core.py": "def run(x):\n    return x + 1\n" * 40,
        "pkg/copy_of_core.py": "def run(x):\n    return x + 1\n" * 40,  # same contents: taken once
        "pkg/README.md": "# pkg\n\nRuns things.\n",
        "pkg/docs/guide.rst": "Guide\n=====\n\nRead me.\n",
        "pkg/notes.txt": "caf\xe9 notes".encode("latin-1"),  # not UTF-8: read with replacement, reported
        "pkg/LICENSE": "Permission is hereby granted, free of charge.\n",
        "pkg/lib.so": b"\x7fELF\x00\x00binary",  # not a text suffix
        "pkg/blob": b"text then \x00 binary",  # no suffix but a NUL byte: binary
        "pkg/py.typed": "",
        "pkg/__pycache__/core.cpython-311.py": "cached\n",
        "pkg-1.0.dist-info/METADATA": "Name: pkg\n",
    })
    licences = _tree(tmp_path / "licenses", {"GPL-3": "GNU GENERAL PUBLIC LICENSE\n" * 30,
                                             "Apache-2.0": "Apache License\n" * 30})
    return [str(packages), str(licences)]


def test_scan_takes_text_files_once_and_leaves_out_binaries_caches_and_metadata(roots):
    files = InstalledTextSource.scan(roots, max_files=100, seed=0).files
    names = [Path(f).name for f in files]
    assert sorted(n for n in names if "core" not in n) == sorted(
        ["__init__.py", "README.md", "guide.rst", "notes.txt", "LICENSE", "GPL-3", "Apache-2.0"])
    assert sorted(n for n in names if "core" in n) in (["core.py"], ["copy_of_core.py"])
    assert list(files) == sorted(files)


def test_selection_is_seeded_capped_and_shares_out_the_roots(roots):
    picked = InstalledTextSource.scan(roots, max_files=4, seed=3).files
    assert picked == InstalledTextSource.scan(roots, max_files=4, seed=3).files
    assert len(picked) == 4
    assert sum("/licenses/" in f for f in picked) == 2  # the small root is not drowned by the large one
    choices = {InstalledTextSource.scan(roots, max_files=4, seed=s).files for s in range(8)}
    assert len(choices) > 1


def test_missing_root_and_roots_without_text_are_named(tmp_path):
    with pytest.raises(DataError, match="data.corpus.roots: '.*nope' does not exist"):
        InstalledTextSource.scan([str(tmp_path / "nope")], max_files=10, seed=0)
    _tree(tmp_path / "bin", {"tool.so": b"\x00", "blob": b"a\x00b"})
    with pytest.raises(DataError, match="hold no readable text file"):
        InstalledTextSource.scan([str(tmp_path / "bin")], max_files=10, seed=0)


def test_default_roots_are_this_pythons_packages():
    roots = default_real_text_roots()
    assert any(r.endswith("site-packages") for r in roots)
    files = InstalledTextSource.scan(roots, max_files=20, seed=0).files
    assert len(files) == 20 and any(f.endswith(".py") for f in files)


def test_datamodule_builds_the_corpus_with_the_folder_pipeline(roots, tmp_path, capfd):
    """Same litdata build and bad-input handling as ``source: folder``: long files split, undecodable bytes
    replaced and reported by file."""
    corpus = CorpusConfig(data_dir=str(tmp_path / "data"), source="installed", roots=roots, max_files=100,
                          max_doc_tokens=256, val_fraction=0.2)
    dm = LongContextDataModule(corpus, BatchingConfig(max_tokens=512))
    dm.prepare_data()
    lengths = load_lengths(tmp_path / "data" / "train").tolist() + load_lengths(tmp_path / "data" / "val").tolist()
    assert max(lengths) == 256 and len(lengths) > len(dm.source.files)  # core.py (1201 bytes) is split
    assert "notes.txt: not valid UTF-8" in capfd.readouterr().err
    batch = next(iter(dm.train_dataloader()))
    assert int(batch["cu_seqlens"][-1]) == batch["input_ids"].shape[1] <= 512
    # the manifest alone tells which files each split holds, and what the builder made of each file
    manifest = read_manifest(tmp_path / "data")
    train_files, val_files = source_file_splits(manifest)
    assert val_files and sorted(train_files + val_files) == sorted(dm.source.files)
    val_lengths = [len(doc["tokens"]) for path in val_files for doc in source_documents(path, manifest)]
    assert sorted(val_lengths) == sorted(load_lengths(tmp_path / "data" / "val").tolist())
    with pytest.raises(DataError, match="a synthetic corpus lists no source files"):
        source_file_splits({"source": {"kind": "synthetic", "num_documents": 10}, "val_fraction": 0.1})


def test_bad_roots_stop_the_command_line_with_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    err = _error_of(capsys, "--data.corpus.source=installed", f"--data.corpus.roots=[{tmp_path / 'nope'}]")
    assert "data.corpus.roots" in err and "does not exist" in err and err.strip().count("\n") == 0
