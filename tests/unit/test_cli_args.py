"""``main(args)``, as the benchmarks call it from scripts with command lines of their own, parses ``args`` alone."""

import sys
import warnings

from main_runner import REPO

from sparsebalance_pl.cli import main


def test_main_parses_its_args_without_warning_about_the_scripts_command_line(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/end_to_end.py", "--ranks", "16"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = main(["--config", str(REPO / "configs" / "demo.yaml"), "--model.attention.tau=0.8"], run=False)
    assert built.model.sparse_attention.config.tau == 0.8
    assert not [w for w in caught if "args parameter" in str(w.message)], [str(w.message) for w in caught]
