"""benchmarks/regime_table.py without data/ or a model: arguments, kinds of documents, streams, the table."""

import sys

import numpy as np
import pytest
from main_runner import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import regime_table as rt  # noqa: E402

from sparsebalance_pl.datamodules.builder import _split  # noqa: E402


def test_defaults_and_lengths_sorted():
    args = rt.parse_args(["--lengths", "4096", "1024", "2048", "1024"])
    assert args.lengths == [1024, 2048, 4096]
    assert args.kinds == ["prose", "code"] and args.taus == [0.8, 0.9, 0.95]
    assert args.tasks == ["passkey", "multikey_niah"] and args.parts == ["quality", "retrieval"]
    assert (args.streams, args.samples, args.split, args.fallback_split) == (1, 2, "val", "train")


@pytest.mark.parametrize("argv, message", [
    (["--kinds", "poetry"], "--kinds poetry: unknown kind; allowed: prose, code"),
    (["--lengths", "1000"], "--lengths 1000: must be a positive multiple of --block-size 64"),
    (["--lengths", "1024", "--block-size", "48"], "--block-size 48: must be a power of two of at least 16"),
    (["--taus", "0"], "--taus 0.0: must lie in (0, 1]"),
    (["--taus", "1.5"], "--taus 1.5: must lie in (0, 1]"),
    (["--streams", "0"], "--streams 0: must be at least 1"),
    (["--samples", "-1"], "--samples -1: must be at least 0"),
    (["--tasks", "trivia"], "--tasks trivia: unknown task"),
    (["--parts", "speed"], "--parts speed: unknown part"),
])
def test_bad_arguments_give_one_line_errors(argv, message):
    with pytest.raises(SystemExit) as error:
        rt.parse_args(argv)
    text = str(error.value.code)
    assert text.startswith("regime_table: error: ") and message in text and "\n" not in text


def test_block_size_128_accepts_its_multiples():
    assert rt.parse_args(["--lengths", "1024", "--block-size", "128"]).lengths == [1024]
    with pytest.raises(SystemExit, match="multiple of --block-size 128"):
        rt.parse_args(["--lengths", "1088", "--block-size", "128"])


@pytest.mark.parametrize("path, kind", [
    ("/x/site-packages/numpy/core/fromnumeric.py", "code"),
    ("/usr/share/common-licenses/GPL-3", "prose"),
    ("/usr/share/common-licenses/Apache-2.0", "prose"),  # ".0" is no suffix of letters
    ("/usr/share/common-licenses/GFDL-1.3", "prose"),
    ("/x/site-packages/pkg/README.md", "prose"),
    ("/x/site-packages/pkg/docs/index.rst", "prose"),
    ("/x/site-packages/pkg/LICENSE.txt", "prose"),
    ("/x/site-packages/pkg/LICENSE", "prose"),
    ("/corpus/books.jsonl:17", "prose"),
])
def test_kind_from_the_source_file_name(path, kind):
    assert rt.classify_path(path) == kind


def test_unknown_suffix_has_no_kind():
    with pytest.raises(ValueError, match="no kind for the suffix '.cfg'"):
        rt.classify_path("/x/setup.cfg")


def test_split_files_follow_the_builder_split():
    files = [f"/x/f{i}.py" for i in range(200)] + ["/licences/GPL-3"]
    manifest = {"source": {"kind": "installed", "files": {f: "1:1" for f in files}}, "val_fraction": 0.1}
    train, val = _split(files, 0.1, 0)
    assert rt.split_files(manifest, "val") == val and rt.split_files(manifest, "train") == train
    assert val and len(train) + len(val) == len(files)
    with pytest.raises(SystemExit, match="--split test: must be train or val"):
        rt.split_files(manifest, "test")
    synthetic = {"source": {"kind": "synthetic", "num_documents": 10}, "val_fraction": 0.1}
    with pytest.raises(SystemExit, match="lists no source files"):
        rt.split_files(synthetic, "val")


def test_documents_matched_to_their_files_by_tokens(tmp_path):
    code, prose, other = tmp_path / "a.py", tmp_path / "GPL-3", tmp_path / "b.cfg"
    code.write_text("import os\nprint(os.sep)\n")
    prose.write_text("Everyone is permitted to copy and distribute verbatim copies of this document. " * 3)
    other.write_text("[metadata]\nname = x\n")
    manifest = {"tokenizer": "byte", "max_doc_tokens": 64, "oversize": "split"}
    files = [str(code), str(prose), str(other), str(tmp_path / "gone.py")]
    pieces = rt.encoded_pieces(files, manifest, {"prose", "code"})
    assert sorted(set(pieces.values())) == ["code", "prose"]
    assert len([k for k in pieces.values() if k == "prose"]) > 1  # split at max_doc_tokens, as the builder does
    docs = [np.frombuffer(b, dtype=np.int64).astype(np.int32) for b in pieces]  # the corpus stores int32
    docs.append(np.arange(5, dtype=np.int32))  # a changed file's document matches nothing
    kinds = rt.match_kinds(docs, pieces)
    assert kinds[:-1] == list(pieces.values()) and kinds[-1] is None
    only_code = rt.encoded_pieces(files, manifest, {"code"})
    assert set(only_code.values()) == {"code"}


class _Documents:
    def __init__(self, found):
        self.found = found

    def get(self, split, kind):
        return self.found[split][kind]


def test_streams_fall_back_to_the_second_split_when_the_first_is_short():
    docs = _Documents({
        "val": {"prose": [np.arange(300)], "code": [np.arange(700), np.arange(700)]},
        "train": {"prose": [np.arange(600), np.arange(600)], "code": []},
    })
    streams, split = rt.kind_streams(docs, ["val", "train"], "code", 512, 2, 0)
    assert split == "val" and [len(s["input_ids"]) for s in streams] == [512, 512]
    streams, split = rt.kind_streams(docs, ["val", "train"], "prose", 512, 1, 0)
    assert split == "train" and len(streams) == 1
    with pytest.raises(SystemExit, match="too few prose tokens in val for 1 streams of 512 tokens"):
        rt.kind_streams(docs, ["val"], "prose", 512, 1, 0)


def _results():
    cell = {"tau": 0.9, "density": 0.4321, "exact_recall": 0.95, "estimated_recall": 0.93,
            "min_layer_exact_recall": 0.8, "dense_loss": 2.5, "loss": 2.55, "loss_gap": 0.02,
            "seconds_per_stream": 12.3}
    retrieval = {"length": 1024, "rows": [
        {"attention": "dense", "tau": None, "density": None, "seconds": 3.0,
         "tasks": {"passkey": {"correct": 2, "samples": 2}, "multikey_niah": {"correct": 1, "samples": 2}}},
        {"attention": "sparse tau 0.9", "tau": 0.9, "density": 0.5, "seconds": 4.0,
         "tasks": {"passkey": {"correct": 1, "samples": 2}}},
    ]}
    meta = {"model": "m", "data": "d", "split": "val", "fallback_split": "train", "block_size": 64, "streams": 1,
            "tasks": ["passkey", "multikey_niah"]}
    quality = [{"length": 1024, "kind": "code", "split": "val", "streams": 1, "documents": 3, "taus": [cell]}]
    return {"meta": meta, "quality": quality, "retrieval": [retrieval]}


def test_table_rows():
    text = rt.markdown(_results())
    lines = text.splitlines()
    assert ("| 1024 | code | 0.9 | 1 (val, 3) | 0.432 | 0.950 | 0.930 | -0.020 | 0.800 | 2.5000 | 2.5500 | +2.00% "
            "| 12 |") in lines
    assert "| length | attention | pass key | needle (multi-key) | density | s |" in lines
    assert "| 1024 | dense | 2/2 | 1/2 | 1.000 | 3 |" in lines
    assert "| 1024 | sparse tau 0.9 | 1/2 | - | 0.500 | 4 |" in lines
    header = next(line for line in lines if line.startswith("| length | kind"))
    assert header.count("|") == lines[lines.index(header) + 1].count("|")


def test_table_without_quality_or_retrieval(tmp_path):
    results = _results()
    results["quality"] = []
    assert "| length | kind" not in rt.markdown(results)
    results = _results()
    results["retrieval"] = []
    assert "Retrieval" not in rt.markdown(results)
    rt.write(tmp_path / "out", results)
    assert (tmp_path / "out" / "results.json").is_file()
    assert (tmp_path / "out" / "results.md").read_text().startswith("Model m")


def test_merge_sorts_the_runs_cells(tmp_path):
    first, second = _results(), _results()
    first["quality"][0]["taus"].append(dict(first["quality"][0]["taus"][0], tau=0.8))
    second["quality"][0].update(length=512, kind="prose")
    second["retrieval"][0]["length"] = 512
    second["retrieval"][0]["rows"].reverse()
    first["meta"]["command"], second["meta"]["command"] = "one", "two"
    rt.write(tmp_path / "a", first)
    rt.write(tmp_path / "b", second)
    merged = rt.merge([tmp_path / "a", tmp_path / "b"])
    assert [(q["length"], q["kind"]) for q in merged["quality"]] == [(512, "prose"), (1024, "code")]
    assert [c["tau"] for c in merged["quality"][1]["taus"]] == [0.8, 0.9]
    assert [r["length"] for r in merged["retrieval"]] == [512, 1024]
    assert [row["attention"] for row in merged["retrieval"][0]["rows"]] == ["dense", "sparse tau 0.9"]
    assert [r["command"] for r in merged["meta"]["runs"]] == ["one", "two"]
    with pytest.raises(SystemExit, match="no results.json there"):
        rt.merge([tmp_path / "c"])
    with pytest.raises(SystemExit, match="--merge needs --out"):
        rt.parse_args(["--merge", str(tmp_path / "a")])
