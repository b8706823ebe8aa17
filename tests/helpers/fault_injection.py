"""Callbacks that inject faults into real training runs, or record them, loaded by ``class_path`` in subprocess
tests."""

import hashlib
import io
import os
import signal
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


class InjectNonFiniteLoss(Callback):
    """Makes the loss of one rank NaN at the given optimiser steps (all steps from ``step`` on if ``persist``)."""

    def __init__(self, rank: int = 0, step: int = 2, persist: bool = False) -> None:
        self.rank, self.step, self.persist = rank, step, persist
        self._hook = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        hit = trainer.global_step >= self.step if self.persist else trainer.global_step == self.step
        if trainer.global_rank == self.rank and hit:
            norm = pl_module.net.hf.model.norm
            self._hook = norm.register_forward_hook(lambda module, args, out: out * torch.nan)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


class PaceSteps(Callback):
    """Writes each global step to ``path`` (rank 0) and slows every step by ``seconds``, so that a test can
    signal a run at a known point while it is still training. With ``while_exists``, only while that file
    exists: a test ends the pacing by deleting it, also for a run whose command it cannot change (a requeued
    SLURM job)."""

    def __init__(self, path: str, seconds: float = 0.3, while_exists: str | None = None) -> None:
        self.path, self.seconds, self.while_exists = path, seconds, while_exists

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if trainer.is_global_zero:
            with open(self.path, "w") as f:
                f.write(str(trainer.global_step))
        if self.while_exists is None or os.path.exists(self.while_exists):
            time.sleep(self.seconds)


class StallRank(Callback):
    """Makes one rank sleep at the start of one step, as a rank stuck outside any collective would."""

    def __init__(self, rank: int = 1, step: int = 3, seconds: float = 600.0) -> None:
        self.rank, self.step, self.seconds = rank, step, seconds

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            time.sleep(self.seconds)


class RecordBatches(Callback):
    """Appends ``<global step> <sha1 of the micro-batch's tokens>`` to ``<path>.<rank>`` for every micro-batch,
    so that a test can compare the samples two runs consumed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        digest = hashlib.sha1(batch["input_ids"].cpu().numpy().tobytes()).hexdigest()
        with open(f"{self.path}.{trainer.global_rank}", "a") as f:
            f.write(f"{trainer.global_step} {digest}\n")


class KillWhileSaving(Callback):
    """SIGKILLs rank 0 half-way through writing ``meta.pt`` of the checkpoint saved at global step ``step``, the
    last file of an FSDP2 checkpoint: every rank's shards and DCP's ``.metadata`` are on disk by then, so what
    the kill leaves looks nearly whole."""

    def __init__(self, step: int = 4) -> None:
        self.step = step

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if trainer.is_global_zero and trainer.global_step == self.step:
            torch.save = _dying_on_meta(torch.save)


def _dying_on_meta(save):
    """``torch.save`` that writes half of ``meta.pt`` and then kills this process."""

    def half_save(obj, f, *args, **kwargs):
        if not isinstance(f, (str, os.PathLike)) or Path(f).name != "meta.pt":
            return save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        save(obj, buffer, *args, **kwargs)
        with open(f, "wb") as out:
            out.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        os.kill(os.getpid(), signal.SIGKILL)

    return half_save
