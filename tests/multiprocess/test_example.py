"""The worked example (examples/tiny_gpt.py) and the README's integration section: a module of its own trains with
SAB and DST through one ``SparseAttention`` and the callbacks, using only public names."""

import ast
import csv
import importlib
import re
import subprocess
import sys

import pytest
from main_runner import REPO

EXAMPLE = REPO / "examples" / "tiny_gpt.py"
PUBLIC = ("sparsebalance_pl.attention", "sparsebalance_pl.callbacks", "sparsebalance_pl.datamodules",
          "sparsebalance_pl.loss")
#: Lines of the example that name the library, by ``library_lines``, before ``SparseAttention`` carried the
#: integration (budgets, timer, selections, the report and the cost model were the example's own then).
LIBRARY_LINES_BEFORE = 35


def library_lines(source: str) -> set[int]:
    """The lines of ``source`` that import from sparsebalance_pl or use what they import (by name, or the module's
    ``sparse_attention``)."""
    tree = ast.parse(source)
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module.startswith("sparsebalance_pl")]
    names = {alias.asname or alias.name for node in imports for alias in node.names}
    lines = {line for node in imports for line in range(node.lineno, node.end_lineno + 1)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Name) and node.id in names) or (
                isinstance(node, ast.Attribute) and node.attr == "sparse_attention"):
            lines.add(node.lineno)
    return lines


def test_the_example_imports_only_public_names_and_half_the_plumbing():
    source = EXAMPLE.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module.startswith("sparsebalance_pl"):
            assert node.module in PUBLIC, node.module
            exported = importlib.import_module(node.module).__all__
            assert all(alias.name in exported and not alias.name.startswith("_") for alias in node.names), node.module
        if isinstance(node, ast.Import):
            assert not any(alias.name.startswith("sparsebalance_pl") for alias in node.names)
    assert len(library_lines(source)) <= LIBRARY_LINES_BEFORE // 2


def readme_integration() -> tuple[list[str], str]:
    """The README's section on using SparseBalance in another project, and the Python code it shows."""
    readme = (REPO / "README.md").read_text()
    section = re.search(r"^## Use it in your own Lightning project\n(.*?)(?=^## )", readme, re.S | re.M).group(0)
    return section.rstrip("\n").splitlines(), re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_integration_snippet_runs_verbatim(tmp_path):
    lines, code = readme_integration()
    assert len(lines) <= 40, len(lines)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=4` reached" in result.stdout + result.stderr


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
