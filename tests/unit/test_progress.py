"""Progress bars: training's counts epochs and batches truly, fresh or resumed; others report in plain lines
where output is not a terminal (a log file, a SLURM job)."""

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from rich.progress import MofNCompleteColumn, TextColumn

from sparsebalance_pl.progress import LoggedProgress, RunProgressBar


def test_off_a_terminal_a_line_per_interval_and_one_when_done(capsys):
    with LoggedProgress(TextColumn("work {task.description}"), MofNCompleteColumn(), interval=3600) as bar:
        task = bar.add_task("a", total=3)
        for _ in range(3):
            bar.advance(task)
    with LoggedProgress(TextColumn("work {task.description}"), interval=0.0, transient=True) as bar:
        task = bar.add_task("b", total=2)
        for _ in range(2):
            bar.update(task, advance=1)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("work") and "elapsed" in line]
    assert [line.split(",")[0] for line in lines] == ["work a: 3/3", "work b: 1/2", "work b: 2/2"]


class _Shown(RunProgressBar):
    """The training bar's (description, done, total) after each batch, as the console would show them."""

    def __init__(self) -> None:
        super().__init__()
        self.shown: list[tuple[str, int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        task = self.progress.tasks[self.train_progress_bar_id]
        self.shown.append((task.description.strip(), int(task.completed), task.total))


def _fit(tmp_path, accumulation: int, max_steps: int, ckpt_path=None) -> list[tuple[str, int, float]]:
    """``max_steps`` optimiser steps on epochs of 32 batches, saving every 5 steps."""
    bar = _Shown()
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, accumulate_grad_batches=accumulation,
                        limit_train_batches=32, limit_val_batches=0, logger=False, enable_model_summary=False,
                        callbacks=[bar, saves], default_root_dir=tmp_path)
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return bar.shown


@pytest.mark.parametrize("accumulation, max_steps, second_epoch", [(1, 40, 8), (3, 15, 12)])
def test_the_training_bar_counts_epochs_and_batches_as_the_run_does_them_fresh_or_resumed(
    tmp_path, accumulation, max_steps, second_epoch
):
    """Two epochs, the second cut short by ``max_steps`` (with 3 batches a step, an epoch of 32 batches has 11
    steps, its last of 2 batches)."""
    fresh = _fit(tmp_path / "fresh", accumulation, max_steps)
    assert fresh == ([("Epoch 1/2", n, 32) for n in range(1, 33)]
                     + [("Epoch 2/2", n, second_epoch) for n in range(1, second_epoch + 1)])
    resumed = _fit(tmp_path / "resumed", accumulation, max_steps, ckpt_path=tmp_path / "fresh" / "epoch=0-step=5.ckpt")
    assert resumed == fresh[5 * accumulation:]
