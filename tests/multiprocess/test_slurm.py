"""SLURM's requeue cycle against a real SLURM started for the test (``slurm_cluster``): ``sbatch
scripts/slurm/train.sbatch`` runs the demo with 2 tasks on this machine's CPUs; shortly before the job's time limit
SLURM sends every task SIGUSR1, the ranks save ``hpc_ckpt_<n>`` at the next optimiser-step boundary, rank 0 runs
``scontrol requeue``, and the job runs again (``SLURM_RESTART_COUNT=1``), resumes from that checkpoint and ends
with the losses of a job that was never interrupted."""

import csv
import json
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from main_runner import HELPERS, REPO, build_demo_data
from slurm_cluster import SlurmCluster, missing_programs, wait_for

from sparsebalance_pl import checkpoints
from sparsebalance_pl.slurm import _requeue

MAX_STEPS = 16
NONFINITE_STEPS = (1, MAX_STEPS - 2)  # before and after the checkpoint
DATA = {"corpus.num_documents": 200, "corpus.max_doc_tokens": 512, "batching.max_tokens": 1024}
CPU_NODE = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"]  # over the GPU defaults
ARGS = [
    "configs/demo.yaml", *(f"--data.{key}={value}" for key, value in DATA.items()),
    "--model.model.overrides={num_layers: 1}", "--trainer.log_every_n_steps=1", f"--trainer.max_steps={MAX_STEPS}",
    "--data.batching.micro_batches=2", "--trainer.accumulate_grad_batches=2",
    # Token-count packing and no DST (the callbacks below replace the demo's): an epoch planned by SAB after the
    # resume, or DST's budgets, follow measured times, which no two runs share.
    "--data.batching.method=first_fit",
    # Validation is on but not due within the run: only an early stop would start it.
    "--trainer.limit_val_batches=2", "--trainer.check_val_every_n_epoch=null", "--trainer.val_check_interval=1000",
]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """munged, slurmctld and slurmd running as this test's processes, one idle node with this machine's CPUs."""
    missing = missing_programs()
    if missing:
        pytest.skip(f"SLURM is not installed here (no {', '.join(missing)}); .ci/run installs it with apt-get "
                    "install slurmctld slurmd slurm-client munge")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _job_env() -> dict[str, str]:
    """This test's environment for the job, without anything of an enclosing SLURM job or launcher: the
    interpreter running the tests first on PATH, the fault-injection callbacks importable."""
    inherited = {k: v for k, v in os.environ.items()
                 if not k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k not in ("MASTER_ADDR", "MASTER_PORT")}
    return {**inherited, "PATH": f"{Path(sys.executable).parent}:{inherited['PATH']}", "PYTHONPATH": str(HELPERS)}


def _submit(slurm: SlurmCluster, run_dir: Path, data: Path, hold: Path) -> str:
    """The batch script with the demo on one CPU node, writing everything under ``run_dir``; steps are slowed
    while ``hold`` exists. NaNs on rank 1 at step 1 and near the end: the resumed job counts its skipped update
    on from the first one's."""
    callbacks = [
        {"class_path": "fault_injection.PaceSteps",
         "init_args": {"path": str(run_dir / "step"), "seconds": 2.0, "while_exists": str(hold)}},
        *({"class_path": "fault_injection.InjectNonFiniteLoss", "init_args": {"rank": 1, "step": step}}
          for step in NONFINITE_STEPS),
    ]
    return slurm.sbatch(
        *CPU_NODE, f"--output={run_dir / 'slurm-%j.out'}", "scripts/slurm/train.sbatch", *ARGS,
        f"--data.corpus.data_dir={data}", f"--trainer.default_root_dir={run_dir}",
        f"--trainer.logger.init_args.save_dir={run_dir}", "--trainer.callbacks=" + json.dumps(callbacks),
        cwd=REPO, env=_job_env(),
    )


def _job_details(slurm: SlurmCluster, job: str, run_dir: Path):
    """What a timed-out wait reports: the job's record and the tail of its output."""
    return lambda: f"job {job}: {slurm.job(job)}\n" + "\n".join(
        p.read_text()[-3000:] for p in run_dir.glob("slurm-*.out"))


def _logged(run_dir: Path, version: int, key: str) -> dict[int, float]:
    with open(run_dir / f"logs/version_{version}/metrics.csv") as f:
        return {int(r["step"]): float(r[key]) for r in csv.DictReader(f) if r.get(key)}


def _seconds(duration: str) -> int:
    """SLURM's [days-]hours:minutes:seconds as seconds."""
    days, _, clock = duration.rpartition("-")
    hours, minutes, seconds = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds


@pytest.mark.slow
def test_sigusr1_before_the_time_limit_saves_requeues_and_the_job_resumes_exactly(slurm, tmp_path):
    build_demo_data(tmp_path, **DATA)
    data = tmp_path / "data" / "demo"
    reference_dir, requeued_dir = tmp_path / "reference", tmp_path / "requeued"
    reference_dir.mkdir()
    requeued_dir.mkdir()
    hold = tmp_path / "hold"
    hold.touch()
    reference = _submit(slurm, reference_dir, data, tmp_path / "never")  # runs first, unpaced
    job = _submit(slurm, requeued_dir, data, hold)  # runs once the reference is done: the node has 2 CPUs

    # Once the job trains, its time limit comes down to a minute or two: SLURM sends SIGUSR1 the script's 120 s
    # before the limit, which lies in the past, at its next check of time limits (every 30 s).
    step = requeued_dir / "step"
    details = _job_details(slurm, job, requeued_dir)
    wait_for(lambda: step.exists() and int(step.read_text() or 0) >= 2, 300, "the job did not train", details)
    submitted = slurm.job(job)
    slurm.scontrol("update", f"JobId={job}", f"TimeLimit={math.ceil(_seconds(submitted['RunTime']) / 60) + 1}")
    wait_for(lambda: slurm.job(job).get("Restarts") == "1" and slurm.job(job)["JobState"] == "PENDING", 120,
             "the job was not requeued", details)
    hold.unlink()
    # Run again at once (a requeued job waits a minute or two otherwise) with the time limit it was submitted with;
    # not within the second it was killed in, whose credentials slurmd refuses ("Job N already killed").
    time.sleep(2)
    slurm.scontrol("update", f"JobId={job}", f"TimeLimit={submitted['TimeLimit']}", "StartTime=now")
    wait_for(lambda: slurm.job(job)["JobState"] == "COMPLETED", 300, "the requeued job did not complete", details)
    assert slurm.job(reference)["JobState"] == "COMPLETED" and slurm.job(job)["ExitCode"] == "0:0"

    output = (requeued_dir / f"slurm-{job}.out").read_text()
    assert f"sparsebalance: job {job}, start 1 (SLURM_RESTART_COUNT=0)" in output
    assert f"sparsebalance: job {job}, start 2 (SLURM_RESTART_COUNT=1)" in output
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in output  # the ranks srun started
    checkpoint = requeued_dir / "hpc_ckpt_1.ckpt"
    assert f"requeue signal: saved {checkpoint} and requeued SLURM job {job}; stopping" in output
    assert f"Restoring states from the checkpoint path at {checkpoint}" in output
    assert (checkpoint / checkpoints.CHECKSUMS).is_file()  # and verified before it was loaded

    meta = torch.load(checkpoint / checkpoints.META, weights_only=False)
    saved_step = meta["global_step"]
    assert NONFINITE_STEPS[0] < saved_step < NONFINITE_STEPS[1]
    # Saved between optimiser steps, never between the two micro-batches of one (their gradients are not saved).
    assert meta["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"] == 2 * saved_step
    # Training stopped at the checkpoint, without validating: the requeued job repeats and skips no step.
    assert sorted(_logged(requeued_dir, 0, "train/loss")) == list(range(saved_step))
    assert not _logged(requeued_dir, 0, "val/loss")
    resumed = _logged(requeued_dir, 1, "train/loss")
    assert sorted(resumed) == list(range(saved_step, MAX_STEPS))
    assert max(_logged(requeued_dir, 1, "train/nonfinite_steps").values()) == 2.0  # counted on from the first

    uninterrupted = _logged(reference_dir, 0, "train/loss")
    assert sorted(uninterrupted) == list(range(MAX_STEPS))
    for step_index, loss in {**_logged(requeued_dir, 0, "train/loss"), **resumed}.items():
        assert loss == pytest.approx(uninterrupted[step_index], abs=1e-6), f"step {step_index}"


def test_failed_requeue_keeps_the_checkpoint_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    with pytest.warns(UserWarning, match="saved hpc_ckpt_1.ckpt, but `scontrol requeue 4242` failed"):
        _requeue("hpc_ckpt_1.ckpt")
