"""The flagship configurations run the whole method: sparsity-aware batching, DST and the plan monitor, from a
latency table profiled on first use for this device, cached and reused. Run on the CPU with 2 ranks and the demo's
architecture in place of Qwen2.5."""

import csv

import pytest
from main_runner import REPO, run_main

PROFILING = "profiling the latency table"


def _fit(run_dir, config: str):
    return run_main(
        run_dir, "fit", "--config", str(REPO / "configs" / config),
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.precision=32-true", "--trainer.max_steps=2",
        "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1",
        "--model.model.preset=demo", "--model.model.overrides={num_layers: 2, max_position_embeddings: 1024}",
        "--model.attention.block_size=64", "--model.activation_checkpointing=false",
        "--data.corpus.tokenizer=byte", "--data.corpus.num_documents=120", "--data.corpus.max_doc_tokens=1024",
        "--data.corpus.build_workers=1", "--data.batching.max_tokens=1024", "--data.batching.num_workers=0",
        timeout=600,
    )


@pytest.mark.slow
@pytest.mark.parametrize("config, out", [("qwen05b.yaml", "outputs/qwen05b")])
def test_profiles_once_and_caches_the_table(tmp_path, config, out):
    first = _fit(tmp_path, config)
    assert first.returncode == 0, first.stderr[-3000:]
    assert PROFILING in first.stderr
    table = tmp_path / out / "latency_table.json"
    rows = list(csv.DictReader(open(tmp_path / out / "logs/version_0/metrics.csv")))
    logged = {key for row in rows for key, value in row.items() if value}
    assert {"dst/anchor_s", "plan/predicted_imbalance", "latency/predicted_s"} <= logged

    written = table.stat().st_mtime_ns
    second = _fit(tmp_path, config)
    assert second.returncode == 0, second.stderr[-3000:]
    assert PROFILING not in second.stderr and table.stat().st_mtime_ns == written
    # a table from another device is profiled again: tests/unit/cost/test_profiler.py


def test_every_flagship_attaches_the_whole_method():
    import yaml

    for config in ("qwen05b.yaml", "qwen3b.yaml", "llama3_1b.yaml", "qwen3_0_6b.yaml"):
        cfg = yaml.safe_load((REPO / "configs" / config).read_text())
        callbacks = {c["class_path"].rsplit(".", 1)[-1] for c in cfg["trainer"]["callbacks"]}
        assert {"DynamicSparsityTuning", "BatchPlanMonitor", "DensityCalibration"} <= callbacks, config
        assert cfg["model"]["latency_profile"] is True and cfg["model"]["latency_table"], config
        assert cfg["data"]["batching"].get("method", "sab") == "sab", config
