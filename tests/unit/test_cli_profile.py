"""`python main.py profile` writes a latency table that fits the configuration's model, configured like `fit`."""

import dataclasses

import pytest
import torch
from main_runner import REPO

from sparsebalance_pl import cli
from sparsebalance_pl.cli import main
from sparsebalance_pl.cost.profiler import ProfileGrid
from sparsebalance_pl.latency import LatencyModel
from sparsebalance_pl.model import PRESETS, ModelDims

CONFIGS = REPO / "configs"
DEMO = str(CONFIGS / "demo.yaml")
SHORT = ["--data.batching.max_tokens=1024", "--data.corpus.max_doc_tokens=1024"]  # a quick grid of seconds


def test_profile_writes_a_table_for_the_configured_model(monkeypatch, tmp_path):
    quick = ProfileGrid.quick  # the quick grid's lengths with the least time per cell (its timing is tested apart)
    monkeypatch.setattr(ProfileGrid, "quick", classmethod(
        lambda cls, max_length: dataclasses.replace(quick(max_length), cell_seconds=0.05, model_steps=4, passes=1)))
    out = main(["profile", "--config", DEMO, *SHORT, "--output", str(tmp_path / "table.json")])
    model = LatencyModel.from_file(out, PRESETS["demo"].dims, block_size=64, stride=16)
    assert max(model.table.lengths) == 1024
    assert model.predict([1024], 0.5) > model.predict([256], 0.5) > 0


def test_profile_stacks_configs_and_overrides_like_fit(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(cli, "profile_hardware", lambda config, kernels, **settings: seen.update(kernels=kernels))
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("model:\n  attention:\n    block_size: 16\n    stride: 8\n")
    main([
        "profile", "--config", DEMO, "--config", str(CONFIGS / "experiments" / "sharp.yaml"), "--config", str(overlay),
        "--model.attention.block_size=32", *SHORT, "--output", str(tmp_path / "table.json"),
    ])
    assert (seen["kernels"].block_size, seen["kernels"].stride) == (32, 8)  # the override beats the overlay


@pytest.mark.parametrize(
    "trainer, device, dtype",
    [
        (["--trainer.accelerator=gpu", "--trainer.precision=bf16-mixed"], "cuda", torch.bfloat16),
        (["--trainer.accelerator=cpu", "--trainer.precision=bf16-mixed"], "cpu", torch.float32),
        (["--trainer.accelerator=gpu", "--trainer.precision=32-true", "--device=cpu"], "cpu", torch.float32),
    ],
)
def test_profile_measures_where_and_how_the_trainer_trains(monkeypatch, tmp_path, trainer, device, dtype):
    seen = {}
    monkeypatch.setattr(cli, "profile_hardware",
                        lambda config, kernels, **settings: seen.update(settings, config=config, kernels=kernels))
    main(["profile", "--config", DEMO, *trainer, *SHORT, "--output", str(tmp_path / "table.json")])
    kernels = seen["kernels"]
    assert (kernels.device, kernels.dtype, seen["max_length"]) == (torch.device(device), dtype, 1024)
    assert (kernels.block_size, kernels.stride) == (64, 16)
    assert ModelDims.from_hf_config(seen["config"]) == PRESETS["demo"].dims and seen["quick"]


def test_profile_needs_somewhere_to_write(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "--config", DEMO])
    assert exit_info.value.code == 2
    assert "--output or model.latency_table" in capsys.readouterr().err


def test_profile_reports_a_bad_setting_in_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "--config", DEMO, "--model.attention.block_size=48", "--output", str(tmp_path / "t.json")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "attention.block_size" in err and "Traceback" not in err


def test_help_lists_profile_and_export_and_their_settings(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "profile" in out and "latency table" in out and "export" in out and "Hugging Face" in out
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    out = capsys.readouterr().out
    assert "--output" in out and "--full" in out and "--device" in out and "model.latency_table" in out
