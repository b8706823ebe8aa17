"""benchmarks/checkpoint_verification.py on a small checkpoint folder: it verifies it, from the page cache and
from disk, and loads it."""

import sys

import pytest
from checkpoint_files import flip_bytes, write_checkpoint
from main_runner import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import checkpoint_verification as cv  # noqa: E402


def test_measures_a_checkpoint_folder(tmp_path, capsys):
    folder = write_checkpoint(tmp_path / "last.ckpt", 2)
    cv.main([str(folder), "--repeats", "1"])
    out = capsys.readouterr().out
    for line in ("verify, files in the page cache", "verify, files read from disk", "DCP load of every tensor",
                 "verification adds"):
        assert line in out, out


def test_refuses_to_measure_a_damaged_checkpoint(tmp_path):
    folder = write_checkpoint(tmp_path / "last.ckpt", 2)
    flip_bytes(folder / "__0_0.distcp")
    with pytest.raises(SystemExit, match="__0_0.distcp differs"):
        cv.main([str(folder), "--repeats", "1"])


def test_needs_a_checkpoint_or_the_qwen_sized_state():
    with pytest.raises(SystemExit):
        cv.parse_args([])
