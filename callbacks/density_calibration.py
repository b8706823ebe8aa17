"""Measure attention density by document length before a fresh run plans its first epoch."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback


class DensityCalibration(Callback):
    """At fit start, run the model at its base budget over a few training documents of every length and teach
    the cost model their densities, unless the cost model has seen densities already (a resumed run).

    The density estimate's length prior can be far from what a trained model selects, and sparsity-aware
    batching would balance the wrong costs for a whole epoch. Works with ``SparseCausalLM`` and
    ``LongContextDataModule``: the module's ``calibrate_density`` runs the forwards (shared out among the
    ranks) and the data module's ``calibration_batches`` picks the documents, ``per_bin`` of each half-octave
    of length.
    """

    def __init__(self, per_bin: int = 2) -> None:
        if per_bin < 1:
            raise ValueError(f"DensityCalibration.per_bin={per_bin} must be at least 1")
        self.per_bin = per_bin

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        density = pl_module.sparse_attention.cost_model.density
        if density is None or density.observed:
            return
        batches = trainer.datamodule.calibration_batches(min_length=density.block_size, per_bin=self.per_bin)
        pl_module.calibrate_density(batches)
