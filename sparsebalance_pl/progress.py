"""Progress bars: training's, and those of long work that also report when output goes to a file.

``RunProgressBar`` is Lightning's rich progress bar counting epochs and batches as the run does them, fresh
or resumed. Where its console is not a terminal, rich draws a bar once, at the end: an hour's run then looks
stuck in its log. ``LoggedProgress`` is rich's bar on a terminal, and elsewhere prints a plain line about each
task every ``interval`` seconds and when it finishes.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from rich.progress import Progress, TaskID, TextColumn

__all__ = ["LoggedProgress", "RunProgressBar"]


class RunProgressBar(RichProgressBar):
    """Lightning's rich progress bar with counts that are true on a fresh and on a resumed run: ``Epoch 1/2``,
    counted from 1 over the epochs the run trains, and the batches done of the current epoch over those it
    trains in it (``training_extent``). Lightning's own counts epochs from 0 over ``max_epochs - 1``, negative
    where ``max_steps`` ends the run, and, resumed, the epoch's batches over the steps the run had left."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self.show_counts(trainer, 0)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.show_counts(trainer, batch_idx + 1)

    def show_counts(self, trainer: L.Trainer, done: int) -> None:
        """The training bar's epoch and its batch total, ``done`` batches into the current epoch (the done count
        is Lightning's: the epoch's batch index, which a resumed run continues)."""
        if self.progress is None or self.train_progress_bar_id is None:
            return
        batches, epochs = training_extent(trainer, done)
        text = f"Epoch {trainer.current_epoch + 1}" + ("" if epochs is None else f"/{epochs}")
        text = f"{text:{len(self.validation_description)}}"  # as long as the validation bar's: no flicker
        style = self.theme.description
        self.progress.update(self.train_progress_bar_id, total=batches,
                             description=f"[{style}]{text}" if style else text)
        self.refresh()


def training_extent(trainer: L.Trainer, done: int) -> tuple[int | float, int | None]:
    """(the batches of the current epoch that training runs, the epochs it runs in all, None if unbounded)
    when ``done`` batches of the epoch are behind it: ``max_steps`` can end the run inside an epoch, and counts
    optimiser steps, one per ``accumulate_grad_batches`` batches and one more for an epoch's last batches.
    Later epochs are taken to be as long as the current one."""
    batches, accumulation = trainer.num_training_batches, trainer.accumulate_grad_batches
    epochs = trainer.max_epochs if trainer.max_epochs not in (None, -1) else None
    if trainer.max_steps < 0 or not math.isfinite(batches):
        return batches, epochs
    steps_left = trainer.max_steps - trainer.global_step
    # the window under way needs what it lacks, and every step left a whole window
    run_to = min(batches, done + max(steps_left * accumulation - done % accumulation, 0))
    per_epoch = math.ceil(batches / accumulation)
    done_steps = math.ceil(done / accumulation) if done >= batches else done // accumulation
    before = trainer.global_step - done_steps  # optimiser steps of the earlier epochs
    needed = trainer.current_epoch + max(math.ceil((trainer.max_steps - before) / per_epoch), 1)
    return run_to, needed if epochs is None else min(epochs, needed)


class LoggedProgress(Progress):
    """``rich.progress.Progress`` that, off a terminal, prints its text columns, then done/total, elapsed
    and remaining time."""

    def __init__(self, *columns: Any, interval: float = 60.0, **kwargs: Any) -> None:
        super().__init__(*columns, **kwargs)
        self.interval = interval
        self.last_report = time.monotonic()
        self.reported_done: set[TaskID] = set()

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self.report(task_id)

    def update(self, task_id: TaskID, **kwargs: Any) -> None:
        super().update(task_id, **kwargs)
        if "completed" in kwargs or "advance" in kwargs:
            self.report(task_id)

    def report(self, task_id: TaskID) -> None:
        """One plain line about the task, if output is not a terminal and it is time (or the task is done)."""
        if self.disable or self.console.is_terminal:
            return
        task = next(t for t in self.tasks if t.id == task_id)
        now = time.monotonic()
        if task_id in self.reported_done or (now - self.last_report < self.interval and not task.finished):
            return
        self.last_report = now
        if task.finished:
            self.reported_done.add(task_id)
        text = " ".join(" ".join(c.render(task).plain.split()) for c in self.columns if isinstance(c, TextColumn))
        total = "" if task.total is None else f"/{task.total:g}"
        left = task.time_remaining
        print(f"{text}: {task.completed:g}{total}, {task.elapsed or 0.0:.0f} s elapsed"
              + ("" if left is None or task.finished else f", about {left:.0f} s left"), flush=True)
