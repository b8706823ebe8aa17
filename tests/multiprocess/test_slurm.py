"""SLURM simulated on this machine: two ranks started the way ``srun`` starts them (SLURM environment variables,
one process per task), SLURM's warning signal in the middle of training (two micro-batches per optimiser step),
a checkpoint at the next step boundary and a requeue, then the requeued job resuming from that checkpoint. ``scontrol`` is a stand-in on PATH that records its arguments."""

import csv
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from main_runner import REPO, finish, start_main
from rank_runner import free_port

from sparsebalance_pl.slurm import _requeue

JOB_ID = "4242"
MAX_STEPS = 12
ARGS = [
    "fit", "--config", str(REPO / "configs" / "demo.yaml"),
    "--data.corpus.num_documents=120", "--data.corpus.max_doc_tokens=512", "--data.batching.max_tokens=1024",
    "--model.model.overrides={num_layers: 2}", "--trainer.limit_val_batches=2", "--trainer.log_every_n_steps=1",
    f"--trainer.max_steps={MAX_STEPS}", "--data.batching.micro_batches=2", "--trainer.accumulate_grad_batches=2",
    # Validation is on but not due within the run: only an early stop would start it.
    "--trainer.check_val_every_n_epoch=null", "--trainer.val_check_interval=1000",
]


def _callbacks(*callbacks: tuple[str, dict]) -> str:
    return "--trainer.callbacks=" + json.dumps(
        [{"class_path": f"fault_injection.{name}", "init_args": args} for name, args in callbacks]
    )


def _start_job(run_dir: Path, port: int, *extra: str) -> list:
    """Both tasks of a one-node, two-task job, as ``srun`` would start them."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    slurm = {
        "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NAME": "sparsebalance", "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PATH": f"{run_dir / 'bin'}:{os.environ['PATH']}",
    }
    return [
        start_main(run_dir, *ARGS, *extra, env={**base, **slurm, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)})
        for r in range(2)
    ]


def _finish_job(tasks: list, timeout: float = 300) -> list:
    results = [finish(task, timeout) for task in tasks]
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stderr[-3000:]}"
    return results


def _logged(run_dir: Path, version: int, key: str) -> dict[int, float]:
    with open(run_dir / f"outputs/demo/logs/version_{version}/metrics.csv") as f:
        return {int(r["step"]): float(r[key]) for r in csv.DictReader(f) if r.get(key)}


@pytest.mark.slow
def test_sigusr1_saves_requeues_and_the_requeued_job_resumes(tmp_path):
    (tmp_path / "bin").mkdir()
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    step_file = tmp_path / "step"

    # First job: a NaN at step 1 (one skipped update to carry over), steps slowed so the signal lands mid-run.
    tasks = _start_job(tmp_path, free_port(), _callbacks(
        ("PaceSteps", {"path": str(step_file), "seconds": 0.5}), ("InjectNonFiniteLoss", {"rank": 1, "step": 1})
    ))
    deadline = time.monotonic() + 240
    while not (step_file.exists() and step_file.read_text() and int(step_file.read_text()) >= 2):
        assert all(t.poll() is None for t in tasks), "a rank ended before the signal"
        assert time.monotonic() < deadline, "training did not reach step 2"
        time.sleep(0.1)
    for task in tasks:  # SLURM signals every task of the job
        task.send_signal(signal.SIGUSR1)
    first = _finish_job(tasks)

    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in first[1].stderr  # ranks from SLURM_PROCID
    assert (tmp_path / "scontrol.log").read_text() == f"requeue {JOB_ID}\n"
    checkpoint = "outputs/demo/hpc_ckpt_1.ckpt"  # in trainer.default_root_dir
    assert (tmp_path / checkpoint / ".metadata").exists()
    meta = torch.load(tmp_path / checkpoint / "meta.pt", weights_only=False)
    saved_step = meta["global_step"]
    assert 2 <= saved_step < MAX_STEPS
    # Saved between optimiser steps, never between the two micro-batches of one (their gradients are not saved).
    assert meta["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"] == 2 * saved_step
    # Training stopped at the checkpoint, without validating: the requeued job must not repeat or skip any step.
    assert sorted(_logged(tmp_path, 0, "train/step_s")) == list(range(saved_step))
    assert not _logged(tmp_path, 0, "val/loss")

    # Requeued job: same command and variables, no ckpt_path. A second NaN shows the skip count carried over.
    second = _finish_job(_start_job(tmp_path, free_port(), _callbacks(
        ("PaceSteps", {"path": str(step_file), "seconds": 0.0}),
        ("InjectNonFiniteLoss", {"rank": 1, "step": saved_step + 1}),
    )))
    assert f"Restoring states from the checkpoint path at {checkpoint}" in second[0].stderr
    assert sorted(_logged(tmp_path, 1, "train/step_s")) == list(range(saved_step, MAX_STEPS))
    assert max(_logged(tmp_path, 1, "train/nonfinite_steps").values()) == 2.0
    assert (tmp_path / "scontrol.log").read_text() == f"requeue {JOB_ID}\n"  # no second requeue


def test_failed_requeue_keeps_the_checkpoint_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_JOB_ID", JOB_ID)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    with pytest.warns(UserWarning, match=f"saved hpc_ckpt_1.ckpt, but `scontrol requeue {JOB_ID}` failed"):
        _requeue("hpc_ckpt_1.ckpt")
