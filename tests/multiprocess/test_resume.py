"""A 2-rank FSDP2 run killed after a checkpoint and resumed continues exactly as if never stopped: the same
samples on every rank (the data module's plan position is part of the checkpoint) and the same losses."""

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from main_runner import HELPERS, REPO

ARGS = [
    "fit", "--config", str(REPO / "configs" / "demo.yaml"),
    "--data.corpus.num_documents=200", "--data.corpus.max_doc_tokens=512", "--data.batching.max_tokens=1024",
    "--model.model.overrides={num_layers: 2}",
    "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1", "--trainer.max_steps=6",
]
# No DST: it decides from measured times, which no two runs share. The recorder writes what each rank consumed.
CALLBACKS = (
    '--trainer.callbacks=[{{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": '
    '{{"dirpath": "outputs/demo/step_checkpoints", "every_n_train_steps": 3, "save_top_k": -1}}}}, '
    '{{"class_path": "fault_injection.RecordBatches", "init_args": {{"path": "{}"}}}}]'
)


def _losses(run_dir: Path, version: int) -> dict[int, float]:
    rows = csv.DictReader(open(run_dir / f"outputs/demo/logs/version_{version}/metrics.csv"))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


def _consumed(run_dir: Path, name: str) -> dict[tuple[int, int], list[str]]:
    """(rank, step) -> digests of the micro-batches that rank consumed at that step."""
    out: dict[tuple[int, int], list[str]] = {}
    for rank in (0, 1):
        for line in (run_dir / f"{name}.{rank}").read_text().splitlines():
            step, digest = line.split()
            out.setdefault((rank, int(step)), []).append(digest)
    return out


def _start(run_dir: Path, record: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "main.py"), *ARGS, CALLBACKS.format(record), *extra], cwd=run_dir,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(HELPERS)},
    )


def _finish(proc: subprocess.Popen, timeout: float = 300) -> None:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]


@pytest.mark.slow
def test_killed_run_resumes_with_identical_losses(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    full.mkdir()
    killed.mkdir()
    _finish(_start(full, "batches"))
    expected = _losses(full, 0)
    assert sorted(expected) == list(range(6))

    proc = _start(killed, "batches_killed")
    checkpoint = killed / "outputs/demo/step_checkpoints/epoch=0-step=3.ckpt"
    deadline = time.time() + 300
    while not (checkpoint / ".metadata").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # let the metadata file finish
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (checkpoint / ".metadata").exists(), "no checkpoint at step 3 before the kill"

    _finish(_start(killed, "batches_resumed", f"--ckpt_path={checkpoint}"))
    resumed = _losses(killed, 1)
    assert sorted(resumed) == [3, 4, 5]
    for step, loss in resumed.items():
        assert loss == pytest.approx(expected[step], abs=1e-6), f"step {step}"
    uninterrupted = {key: digests for key, digests in _consumed(full, "batches").items() if key[1] >= 3}
    assert _consumed(killed, "batches_resumed") == uninterrupted
