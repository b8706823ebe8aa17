"""Logging what the batch plan predicted, step by step, beside what training measured."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback


class BatchPlanMonitor(Callback):
    """Logs each step's predicted imbalance (max/mean rank cost) and tokens per rank, and each epoch's
    predicted balance efficiency, from the data module's plan (``LongContextDataModule``).

    Every rank computes the same plan, so the values are logged without communication.
    """

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        sampler = getattr(trainer.datamodule, "train_sampler", None)
        accumulation = trainer.accumulate_grad_batches
        if sampler is None or batch_idx % accumulation:
            return
        plan = sampler.plan()
        step = batch_idx // accumulation
        if step >= len(plan):
            return
        planned = plan[step]
        pl_module.log_dict(
            {
                "plan/predicted_imbalance": planned.imbalance,
                "plan/tokens_max": float(planned.tokens.max()),
                "plan/tokens_min": float(planned.tokens.min()),
            },
            batch_size=1,
        )

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        efficiency = getattr(trainer.datamodule, "planned_efficiency", {}).get(trainer.current_epoch)
        if efficiency is not None:
            pl_module.log("plan/predicted_efficiency", efficiency)
