"""What a LightningModule offers so that dynamic sparsity tuning can balance it.

``DynamicSparsityTuning`` works with any LightningModule that has the three members of ``SparsityTunable``;
``SparseQwen`` is one. Before each training micro-batch the callback reads the micro-batch's documents and
writes per-layer budgets. After it, the callback reads what the run's ``CostModel`` learned from the step,
and learning is the module's part: after its backward it reports what attention did (a ``SparsityReport``,
timed where no collective runs: under FSDP or DDP whole-step times of all ranks look alike) and hands it to
the cost model on every rank::

    def on_after_backward(self):
        observe_step(self.cost_model, self.lengths_of_last_batch, self.sparsity_report())

``SparseQwen`` does exactly this whether or not the callback is attached, so a run without DST still
calibrates the cost model its batch planner uses. The callback gets the same cost model with ``connect``.

Optional: ``stream_share(batch) -> float``, the part of a micro-batch's documents this rank computes: ``1 / W``
when a context-parallel group of W ranks shares the stream (pass the same share to ``observe_step``, and
the seconds the ring's transfers kept attention waiting as ``SparsityReport.ring_seconds``: ``sparse_ring_attention``
times them with ``wait_timer``); 1 when the module lacks it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from sparsebalance_pl.cost import TIMED_TERMS, CostModel, SparsityReport, observe_step
from sparsebalance_pl.kernels.selection import BudgetedSelection, LayerBudget, select_with_budget
from sparsebalance_pl.timing import AttentionTimer

__all__ = [
    "TIMED_TERMS",
    "AttentionTimer",
    "BudgetedSelection",
    "CostModel",
    "LayerBudget",
    "SparsityReport",
    "SparsityTunable",
    "missing_members",
    "observe_step",
    "select_with_budget",
]


@runtime_checkable
class SparsityTunable(Protocol):
    """The members ``DynamicSparsityTuning`` uses.

    Attributes:
        layer_budgets: the budget (``LayerBudget``: tau, max_density, density_scale) of each sparse layer,
            read at every forward; the callback replaces it before each training micro-batch. A module honours
            ``density_scale`` by keeping at most that multiple of the tiles its base budget would keep in the
            layer.
        base_budgets: the configured budgets, which tuning moves away from by at most p.
    """

    layer_budgets: list[LayerBudget]
    base_budgets: list[LayerBudget]

    def document_lengths(self, batch: Any) -> list[int]:
        """Token count of each document of a training micro-batch (called before its forward)."""
        ...


def stream_share(module: object, batch: Any) -> float:
    """The part of ``batch``'s documents ``module`` computes on this rank (its optional ``stream_share``; 1.0
    without it)."""
    share = getattr(module, "stream_share", None)
    return 1.0 if share is None else float(share(batch))


def missing_members(module: object) -> list[str]:
    """The ``SparsityTunable`` members ``module`` lacks (empty when it implements the protocol)."""
    members = ("layer_budgets", "base_budgets", "document_lengths")
    return [name for name in members if not hasattr(module, name)]
