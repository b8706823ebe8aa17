"""The worked example (examples/tiny_gpt.py): a module of its own trains with SAB and DST on 2 CPU ranks, using
only public names."""

import ast
import csv
import importlib
import subprocess
import sys

import pytest
from main_runner import REPO

EXAMPLE = REPO / "examples" / "tiny_gpt.py"
PUBLIC = ("sparsebalance_pl.callbacks", "sparsebalance_pl.cost", "sparsebalance_pl.cost.profiler",
          "sparsebalance_pl.datamodules", "sparsebalance_pl.kernels")


def test_the_example_imports_only_public_names():
    for node in ast.walk(ast.parse(EXAMPLE.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module.startswith("sparsebalance_pl"):
            assert node.module in PUBLIC, node.module
            exported = importlib.import_module(node.module).__all__
            assert all(alias.name in exported and not alias.name.startswith("_") for alias in node.names), node.module
        if isinstance(node, ast.Import):
            assert not any(alias.name.startswith("sparsebalance_pl") for alias in node.names)


@pytest.mark.slow
def test_the_example_trains_with_sab_and_dst_on_two_ranks(tmp_path):
    result = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "6", "--out", str(tmp_path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mean measured attention imbalance over 6 steps" in result.stdout
    rows = list(csv.DictReader(open(tmp_path / "logs" / "version_0" / "metrics.csv")))
    logged = {key for row in rows for key, value in row.items() if value}
    assert {"dst/measured_imbalance", "dst/prediction_error", "plan/predicted_imbalance"} <= logged
    assert {"latency/rank0/measured_s", "latency/rank1/measured_s"} <= logged  # the cost model learned each step
