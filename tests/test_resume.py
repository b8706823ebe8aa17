"""A 2-rank FSDP2 run killed after a checkpoint and resumed continues exactly as if never stopped: same
batches (the data module's plan position is part of the checkpoint) and the same losses."""

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ARGS = [
    "fit", "--config", str(REPO / "configs" / "demo.yaml"),
    "--data.num_documents=200", "--data.max_doc_tokens=512", "--data.max_tokens=1024",
    "--model.model.overrides={num_layers: 2}",
    "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1", "--trainer.max_steps=6",
    # Only a checkpoint callback: dynamic sparsity tuning decides from measured times, which no two runs share.
    '--trainer.callbacks=[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": '
    '{"dirpath": "outputs/demo/step_checkpoints", "every_n_train_steps": 3, "save_top_k": -1}}]',
]


def _losses(run_dir: Path, version: int) -> dict[int, float]:
    rows = csv.DictReader(open(run_dir / f"outputs/demo/logs/version_{version}/metrics.csv"))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


def _start(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "main.py"), *ARGS, *extra], cwd=run_dir, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 300) -> None:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]


@pytest.mark.slow
def test_killed_run_resumes_with_identical_losses(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    full.mkdir()
    killed.mkdir()
    _finish(_start(full))
    expected = _losses(full, 0)
    assert sorted(expected) == list(range(6))

    proc = _start(killed)
    checkpoint = killed / "outputs/demo/step_checkpoints/epoch=0-step=3.ckpt"
    deadline = time.time() + 300
    while not (checkpoint / ".metadata").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # let the metadata file finish
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (checkpoint / ".metadata").exists(), "no checkpoint at step 3 before the kill"

    _finish(_start(killed, f"--ckpt_path={checkpoint}"))
    resumed = _losses(killed, 1)
    assert sorted(resumed) == [3, 4, 5]
    for step, loss in resumed.items():
        assert loss == pytest.approx(expected[step], abs=1e-6), f"step {step}"
