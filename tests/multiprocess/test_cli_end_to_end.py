"""`python main.py fit` and `validate` as users run them: 2 FSDP2 ranks on the CPU, bounded in time."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from main_runner import REPO

SMALL = [
    "--config", str(REPO / "configs" / "demo.yaml"),
    "--data.corpus.num_documents=120", "--data.corpus.max_doc_tokens=1024", "--data.batching.max_tokens=1024",
    "--model.model.overrides={num_layers: 2}",
    "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
]


def _run(cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, str(REPO / "main.py"), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_fit_then_validate_from_checkpoint(tmp_path):
    _run(tmp_path, "fit", *SMALL, "--trainer.max_steps=4", "--trainer.val_check_interval=2")
    rows = list(csv.DictReader(open(tmp_path / "outputs/demo/logs/version_0/metrics.csv")))
    train_losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    val_losses = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    densities = [float(r["train/density"]) for r in rows if r.get("train/density")]
    assert train_losses and val_losses and densities
    assert all(0 < d <= 1 for d in densities)
    checkpoint = tmp_path / "outputs/demo/checkpoints/last.ckpt"
    assert checkpoint.exists()
    result = _run(tmp_path, "validate", *SMALL, f"--ckpt_path={checkpoint}")
    assert "val/loss" in result.stdout
    result = _run(tmp_path, "test", *SMALL, f"--ckpt_path={checkpoint}", "--data.evaluation.lengths=[256, 512]",
                  "--data.evaluation.samples_per_cell=2")
    for cell in ("passkey@256", "multikey_niah@512", "kv_retrieval@512"):
        assert f"test/accuracy/{cell}" in result.stdout


@pytest.mark.slow
def test_context_parallel_overlay_trains_documents_longer_than_a_rank(tmp_path):
    """configs/context_parallel.yaml on a small corpus: documents up to twice a rank's max_tokens train whole
    across the 2 ranks of the group, and the loss falls."""
    _run(tmp_path, "fit", *SMALL, "--config", str(REPO / "configs" / "context_parallel.yaml"),
         "--data.batching.max_tokens=512", "--data.corpus.max_doc_tokens=1024", "--trainer.max_steps=8",
         "--trainer.val_check_interval=4")
    rows = list(csv.DictReader(open(tmp_path / "outputs/context_parallel/logs/version_0/metrics.csv")))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    shares = [float(r["train/tokens"]) for r in rows if r.get("train/tokens")]
    shared = [float(r["train/shared_stream"]) for r in rows if r.get("train/shared_stream")]
    assert max(shares) <= 512  # no rank holds more than its max_tokens
    assert 0.0 in shared and 1.0 in shared  # documents of up to 512 tokens split over the ranks, longer ones shared
    assert losses[-1] < losses[0]
    ring = [(float(r["train/shared_stream"]), float(r["latency/ring_predicted_s"]), float(r["latency/ring_wait_s"]))
            for r in rows if r.get("latency/ring_wait_s")]
    assert all((p > 0) == (w > 0) == (s == 1.0) for s, p, w in ring)  # waits and their price on shared steps only
    assert {s for s, _, _ in ring} == {0.0, 1.0}


def test_a_context_parallel_size_that_does_not_divide_the_world_stops_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "main.py"), "fit", *SMALL, "--trainer.strategy.init_args.context_parallel_size=3",
         "--trainer.max_steps=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    assert "context_parallel_size=3 does not divide the world of 2 ranks" in result.stderr
