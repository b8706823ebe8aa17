"""What a LightningModule offers so that dynamic sparsity tuning can balance it (DESIGN.md 4.4, 5).

``DynamicSparsityTuning`` works with any LightningModule that has these few members; ``SparseQwen`` is one.
The callback reads the micro-batch's documents before the forward, writes per-layer budgets, and after the
step reads back what the budgets did and how long the attention calls took, timed where no collective runs
(DESIGN.md 3: under FSDP or DDP whole-step times of all ranks look alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from sparsebalance_pl.attention import LayerBudget
from sparsebalance_pl.datamodules.density import DensityEstimator
from sparsebalance_pl.latency import LatencyModel

#: The latency-model terms that ``SparsityReport.attention_seconds`` covers: block selection + attention core.
TIMED_TERMS = ("attention", "selection")


@dataclass(frozen=True)
class SparsityReport:
    """What the last training micro-batch's forward and backward did, as host numbers.

    Attributes:
        density: per sparse layer, kept fraction of causal tiles at the budget in use.
        estimated_recall: per sparse layer, the selection's estimated share of attention mass kept.
        base_document_density: per document of the micro-batch, the density (mean over layers) it would
            have had at ``base_budgets``, from the same ranking: what predicts the cost of later batches.
        attention_seconds: measured seconds of selection + attention core (``TIMED_TERMS``), forward and
            backward, free of collectives.
        recall: exact recall on sampled rows (mean over layers) when the module measures it, else None.
    """

    density: list[float]
    estimated_recall: list[float]
    base_document_density: list[float]
    attention_seconds: float
    recall: float | None = None

    @property
    def mean_density(self) -> float:
        return sum(self.density) / len(self.density)

    @property
    def mean_estimated_recall(self) -> float:
        return sum(self.estimated_recall) / len(self.estimated_recall)


@runtime_checkable
class SparsityTunable(Protocol):
    """The members ``DynamicSparsityTuning`` uses.

    Attributes:
        layer_budgets: the budget (``LayerBudget``: tau, max_density, density_scale) of each sparse layer,
            read at every forward; the callback replaces it before each training micro-batch. A module
            honours ``density_scale`` by keeping at most that multiple of the tiles its base budget would keep
            in the layer.
        base_budgets: the configured budgets, which tuning moves away from by at most p.
        latency_model: predicts a micro-batch's time (``sparsebalance_pl.latency.LatencyModel``); set by
            the module by the time ``on_fit_start`` runs. The callback calibrates it in place.
        density_estimator: each document's density at the base budget by length; the callback refines it
            from the densities the selection actually chose, identically on every rank (the batch planner
            reads it through the module's document costs).
    """

    layer_budgets: list[LayerBudget]
    base_budgets: list[LayerBudget]
    latency_model: LatencyModel | None
    density_estimator: DensityEstimator

    def document_lengths(self, batch: Any) -> list[int]:
        """Token count of each document of a training micro-batch (called before its forward)."""
        ...

    def sparsity_report(self) -> SparsityReport | None:
        """What the last training micro-batch did (after its backward), or None when no layer was sparse."""
        ...
