"""A non-finite loss on one rank skips that update on every rank; too many stop the run with a message."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ARGS = [
    "fit", "--config", str(REPO / "configs" / "demo.yaml"),
    "--data.num_documents=120", "--data.max_doc_tokens=512", "--data.max_tokens=1024",
    "--model.model.overrides={num_layers: 2}", "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1",
    "--trainer.callbacks+=fault_injection.InjectNonFiniteLoss",
]


def _run(cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests" / "helpers")}
    return subprocess.run([sys.executable, str(REPO / "main.py"), *ARGS, *extra], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_nan_on_one_rank_is_skipped_on_both_and_training_continues(tmp_path):
    result = _run(tmp_path, "--trainer.max_steps=5", "--trainer.callbacks.init_args.rank=1",
                  "--trainer.callbacks.init_args.step=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "non-finite loss at step 2" in result.stderr
    rows = list(csv.DictReader(open(tmp_path / "outputs/demo/logs/version_0/metrics.csv")))
    losses = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    skipped = [float(r["train/nonfinite_steps"]) for r in rows if r.get("train/nonfinite_steps")]
    assert max(skipped) == 1.0  # one skipped update in the run
    # Training went on past the poisoned step with finite, falling losses: no NaN reached either rank's weights.
    assert sorted(losses) == [0, 1, 2, 3, 4]
    assert all(loss == loss for loss in losses.values())
    assert losses[4] < losses[3] < losses[1]


@pytest.mark.slow
def test_persistent_nan_stops_with_a_message(tmp_path):
    result = _run(tmp_path, "--trainer.max_steps=8", "--trainer.callbacks.init_args.step=1",
                  "--trainer.callbacks.init_args.persist=true", "--model.max_nonfinite_steps=2")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "error: the loss was not finite at step 3" in result.stderr  # steps 1 and 2 skipped, 3 is one too many
    assert "max_nonfinite_steps=2" in result.stderr
