"""Checkpoint and requeue on SLURM's warning signal, at a step boundary every rank agrees on.

Lightning's own SLURM auto-requeue saves the checkpoint inside the signal handler, wherever each rank's main
thread happens to be. Under FSDP2 saving is a collective that gathers the sharded state: a rank interrupted
inside a forward pass saves between the layers' all-gathers and the run crashes (seen here: "aten.mul.Tensor
got mixed torch.Tensor and DTensor") or hangs (Lightning issue #21406). ``SlurmRequeue`` only notes the
signal in the handler. At the end of the next optimiser step (the last micro-batch it accumulates) the ranks
agree on it (one all-reduce of a flag), save ``hpc_ckpt_<n>.ckpt`` into ``trainer.default_root_dir``
together and stop training, without the validation pass an early stop would otherwise run; once Lightning has
logged that step, they write out their logs and rank 0 runs ``scontrol requeue``. The requeued job's ``fit``
resumes from that checkpoint by itself: under SLURM, without a ``ckpt_path``, Lightning resumes from the newest
``hpc_ckpt_*`` of the default root directory.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

__all__ = ["SlurmRequeue", "next_hpc_checkpoint"]


def next_hpc_checkpoint(root_dir: str | os.PathLike) -> str:
    """``hpc_ckpt_<n>.ckpt`` in ``root_dir``, one past the highest there: the name under which Lightning's resume
    under SLURM, which loads the highest, finds the newest save. Names are read as that resume reads them: every
    name holding ``hpc_ckpt_``, numbered by the digits after it."""
    numbers = [int(digits) for path in Path(root_dir).glob("*hpc_ckpt_*")
               if (digits := re.sub(r"\D", "", path.name.split("hpc_ckpt_")[-1]))]
    return str(Path(root_dir) / f"hpc_ckpt_{max(numbers, default=0) + 1}.ckpt")


class SlurmRequeue(Callback):
    """On SLURM's requeue signal (``SIGUSR1`` unless the ``SLURMEnvironment`` says otherwise): save, requeue
    the job, stop. Does nothing outside SLURM or when the environment's ``auto_requeue`` is off.

    Add it to the trainer's callbacks (``main.py fit`` does when it runs under SLURM); it replaces Lightning's
    own requeue handler for the run.
    """

    def __init__(self) -> None:
        self._environment: SLURMEnvironment | None = None
        self._previous_handler = None
        self._signalled = False
        self._saved: str | None = None  # the checkpoint saved on the signal, until the job is requeued

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if stage != "fit" or not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
            return
        environment.auto_requeue = False  # Lightning installs its in-handler save only while this is on
        self._environment = environment
        self._signalled, self._saved = False, None
        self._previous_handler = signal.signal(environment.requeue_signal, self._note_signal)

    def _note_signal(self, signum: int, frame) -> None:
        self._signalled = True

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        if self._environment is None or not _ends_optimizer_step(trainer, batch_idx):
            return  # a checkpoint between micro-batches would lose the gradients accumulated so far
        if not trainer.strategy.reduce_boolean_decision(self._signalled, all=False):
            return
        # One name for every rank: each listing the folder on its own could see another rank's new checkpoint.
        self._saved = trainer.strategy.broadcast(next_hpc_checkpoint(trainer.default_root_dir))
        trainer.save_checkpoint(self._saved)
        # Stop without the validation pass Lightning runs when training stops early: the requeue's SIGTERM
        # would cut it off. (With trainer.min_steps not yet reached Lightning goes on; the requeue then comes
        # at the next batch's start, and SLURM ends the job.)
        trainer.limit_val_batches = 0
        trainer.should_stop = True

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._requeue_saved(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._requeue_saved(trainer)

    def _requeue_saved(self, trainer: L.Trainer) -> None:
        """Requeues the job once the step that saved has been logged (Lightning logs a step's metrics after its
        batch-end hooks): ``scontrol requeue`` ends the job at once, so the logs are written out first."""
        if self._saved is None:
            return
        for logger in trainer.loggers:
            logger.finalize("finished")
        trainer.strategy.barrier("slurm_requeue")
        if trainer.is_global_zero:
            _requeue(self._saved)
        self._saved = None

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()  # a failed fit does not reach teardown

    def _restore(self) -> None:
        if self._environment is not None:
            previous = self._previous_handler  # None: set outside Python, not restorable
            signal.signal(self._environment.requeue_signal, signal.SIG_DFL if previous is None else previous)
            self._environment.auto_requeue = True
            self._environment = None


def _ends_optimizer_step(trainer: L.Trainer, batch_idx: int) -> bool:
    """Whether this batch completes an optimiser step (the last of its accumulated micro-batches, or of the
    epoch), as Lightning decides it."""
    last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    return last or (batch_idx + 1) % trainer.accumulate_grad_batches == 0


def _requeue(checkpoint: str) -> None:
    """``scontrol requeue`` this job (or array task); a failure leaves the checkpoint for a manual resubmission."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, check=False)
        failure = f"exit code {result.returncode}: {result.stderr.strip()}" if result.returncode else None
    except OSError as err:
        failure = str(err)
    if failure:
        rank_zero_warn(f"saved {checkpoint}, but `scontrol requeue {job}` failed ({failure}): resubmit the job")
    else:
        rank_zero_info(f"requeue signal: saved {checkpoint} and requeued SLURM job {job}; stopping")
