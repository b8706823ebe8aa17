"""`python main.py profile` writes a latency table that fits the configuration's model."""

from pathlib import Path

import pytest

from sparsebalance_pl.cli import main
from sparsebalance_pl.latency import LatencyModel
from sparsebalance_pl.model import PRESETS

DEMO = str(Path(__file__).resolve().parent.parent / "configs" / "demo.yaml")


def test_profile_writes_a_table_for_the_configured_model(tmp_path):
    out = main(["profile", "--config", DEMO, "--output", str(tmp_path / "table.json")])
    model = LatencyModel.from_file(out, PRESETS["demo"], block_size=64, stride=16)
    assert model.predict([4096], 0.5) > model.predict([1024], 0.5) > 0


def test_profile_needs_somewhere_to_write(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "--config", DEMO])
    assert exit_info.value.code == 2
    assert "--output or model.latency_table" in capsys.readouterr().err
