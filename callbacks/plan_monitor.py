"""Logging what the batch plan predicted, step by step, beside what training measured."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback

from sparsebalance_pl.datamodules import PlannedBatchSampler


class BatchPlanMonitor(Callback):
    """Logs each step's predicted imbalance (max/mean rank cost) and tokens per rank, and each epoch's
    predicted balance efficiency, from the plan of the training loader's batch sampler (a
    ``SparsityAwareSampler``, as ``LongContextDataModule`` uses, or any ``PlannedBatchSampler``).

    Every rank computes the same plan, so the values are logged without communication.
    """

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        sampler = _planned_sampler(trainer)
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
        sampler = _planned_sampler(trainer)
        efficiency = getattr(sampler, "planned_efficiency", {}).get(trainer.current_epoch)
        if efficiency is not None:  # the same on every rank; sync_dist only tells Lightning so
            pl_module.log("plan/predicted_efficiency", efficiency, sync_dist=True)


def _planned_sampler(trainer: L.Trainer) -> PlannedBatchSampler | None:
    sampler = getattr(trainer.train_dataloader, "batch_sampler", None)
    return sampler if isinstance(sampler, PlannedBatchSampler) else None
