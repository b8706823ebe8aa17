"""Dynamic sparsity tuning (DST) as a Lightning callback: a thin adapter around ``DSTController``.

Before each training micro-batch every rank shares its documents' lengths (one all-gather of a few integers),
and every rank runs the same controller on all of them: it picks the anchor and every rank's budgets, and
each rank applies its own to the module's ``SparseAttention``. After each backward the run's ``CostModel`` (the
one the ``SparseAttention`` owns, and the controller predicts with) learns what the step's attention did on every
rank (``SparseAttention.observe``), and after the step the callback logs the predicted and measured balance. The
controller's state is identical on every rank, so the checkpoint written by rank 0 resumes every rank. Nothing
communicates inside the layers.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import numpy as np
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from sparsebalance_pl.attention import SparseAttention, SparsityTunable
from sparsebalance_pl.balance import balance_efficiency, imbalance
from sparsebalance_pl.cost import StepObservation
from sparsebalance_pl.distributed import gather_objects
from sparsebalance_pl.dst import Anchor, DSTController, check_settings, confidence
from sparsebalance_pl.lazy_exports import MOVED_NAMES_REMOVED_IN


class DynamicSparsityTuning(Callback):
    """Moves each rank's sparse-attention budget so its predicted step time approaches a common anchor.

    Works with any LightningModule whose attention layers attend through a ``SparseAttention`` held as its
    ``sparse_attention`` (``sparsebalance_pl.attention.SparsityTunable``), predicting with that object's cost
    model. After every backward the cost model learns from the step (``SparseAttention.observe``, which a module
    may also call itself: it learns once). With ``p=0`` budgets stay at the base (the static baseline) while the
    cost model still learns and the logging runs.

    How soon DST acts depends on where its cost model starts: it holds the base budgets while a step's predicted
    imbalance lies within the cost model's own recent error (``dst/prediction_error``), and moves only part of
    the way while that error is large (``dst/confidence``). A table profiled for the module on this machine
    (``SparseAttention.profile``) starts that error at the spread of the profile's own timings, so DST acts from
    the first step; the analytic FLOP prior starts it at 1.0, and DST then waits until measured steps have brought
    it down, which on a module the prior fits badly can take longer than a short run.

    Args:
        anchor: ``mean`` (default), ``median``, ``min``, ``max`` of the ranks' predicted times at the base
            budget, or ``adaptive`` (``DSTController``); raised to the longest time a rank takes at its sparsest.
        p: largest move of tau away from the base budget, in [0, 1]. The kept tiles scale with the cost model so
            that no rank passes the anchor time: a straggler's scale brings it down to the anchor (no lower than
            ``min_density``), a fast rank's stops it there (``sparsebalance_pl.dst.budget``).
        min_density: the lowest density a straggler aims at, in [0, 1].
        recall_tolerance: the adaptive anchor's allowance for predicted loss of mean recall.

    It logs the anchor, the predicted and measured balance, and every rank's budget, density, recall and speed,
    the same on every rank, so a run shows what DST decided and what it bought: ``docs/metrics.md`` lists the keys.
    """

    def __init__(
        self, anchor: Anchor = "mean", p: float = 0.1, min_density: float = 0.05, recall_tolerance: float = 0.02
    ) -> None:
        check_settings(type(self).__name__, anchor, p, min_density, recall_tolerance)
        self.anchor, self.p, self.min_density, self.recall_tolerance = anchor, p, min_density, recall_tolerance
        self.sparse_attention: SparseAttention | None = None
        self.controller: DSTController | None = None
        self._restored: dict[str, Any] | None = None
        self._seen: StepObservation | None = None
        self._warned_uncalibrated = False
        self._epoch_measured: list[np.ndarray] = []
        self._epoch_recall: list[tuple[float, float]] = []  # (tokens, recall) per rank and step

    @property
    def state_key(self) -> str:
        return self._generate_state_key(anchor=self.anchor, p=self.p)

    def connect(self, cost_model: object) -> None:
        """Deprecated: the callback predicts with the cost model of the module's ``sparse_attention``."""
        warnings.warn(
            f"{type(self).__name__}.connect is no longer needed: it predicts with the cost model of the module's "
            f"sparse_attention, and ignores this one (connect goes in sparsebalance-pl {MOVED_NAMES_REMOVED_IN})",
            FutureWarning, stacklevel=2,
        )

    # ------------------------------------------------------------------------------------------ set-up
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Checked here, after the module's own ``setup``, so a module may build its members there."""
        sparse = getattr(pl_module, "sparse_attention", None)
        if not isinstance(sparse, SparseAttention):
            raise TypeError(
                f"{type(self).__name__} needs a LightningModule whose attention layers attend through a "
                f"SparseAttention held as its sparse_attention (sparsebalance_pl.attention.SparsityTunable); "
                f"{type(pl_module).__name__} has none"
            )
        self.sparse_attention = sparse
        self.controller = DSTController(
            sparse.cost_model, sparse.base_budgets, anchor=self.anchor, p=self.p, min_density=self.min_density,
            recall_tolerance=self.recall_tolerance, name=type(self).__name__,
        )
        state, self._restored = self._restored, None
        if state:
            budgets = self.controller.load_state_dict(state)
            if len(budgets) == trainer.world_size:
                sparse.budgets = budgets[trainer.global_rank]
            elif budgets:
                rank_zero_warn(f"DST state is from {len(budgets)} ranks, this run has {trainer.world_size}: "
                               "budgets restart from the base")

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_measured, self._epoch_recall = [], []

    # ----------------------------------------------------------------------------------- before a step
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: SparsityTunable, batch: Any, batch_idx: int) -> None:
        sparse = self.sparse_attention
        gathered = gather_objects(([int(n) for n in sparse.document_lengths(batch)], sparse.stream_share(batch)))
        decision = self.controller.plan([ls for ls, _ in gathered], [x for _, x in gathered])
        sparse.budgets = decision.ranks[trainer.global_rank].budgets
        cost_model = sparse.cost_model
        logs = {
            "dst/anchor_s": decision.anchor,
            "dst/prediction_error": cost_model.error,
            "dst/confidence": confidence(cost_model.error),
            "dst/predicted_imbalance_base": imbalance(decision.predicted_base),
            "dst/predicted_imbalance": imbalance(decision.predicted),
        }
        if decision.anchor_drift is not None:
            logs["dst/anchor_drift"] = decision.anchor_drift
        if self.controller.anchor == "adaptive":
            slowest_rank = int(np.argmax(decision.predicted_base))
            cut, raised = cost_model.recall_prices.prices(gathered[slowest_rank][0])
            logs.update({"dst/recall_per_density_cut": cut, "dst/recall_per_density_raised": raised})
        fastest, slowest = min(decision.predicted_base), max(decision.predicted_base)
        if slowest > fastest:
            logs["dst/anchor_position"] = (decision.anchor - fastest) / (slowest - fastest)
        for r, (base, moved) in enumerate(zip(decision.predicted_base, decision.predicted)):
            logs.update({f"dst/rank{r}/predicted_base_s": base, f"dst/rank{r}/predicted_s": moved})
        _log(pl_module, logs)

    # ------------------------------------------------------------------------------------ after a step
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.sparse_attention.observe()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        cost_model = self.sparse_attention.cost_model
        observation = cost_model.last_step
        if observation is None or observation is self._seen:
            if not self._warned_uncalibrated:
                self._warned_uncalibrated = True
                rank_zero_warn(
                    "DynamicSparsityTuning: no attention layer called sparse_attention.attend in this step, so the "
                    "cost model learned nothing from it and DST predicts from an uncalibrated model"
                )
            return
        self._seen = observation
        logs: dict[str, float] = {"dst/measured_imbalance": observation.measured_imbalance}
        for rank, (record, budget) in enumerate(zip(observation.records, self.controller.last.ranks)):
            report, first = record.report, budget.budgets[0]
            logs.update({
                f"latency/rank{rank}/predicted_s": observation.predicted[rank],
                f"latency/rank{rank}/measured_s": observation.measured[rank],
                f"dst/rank{rank}/tau": first.tau,
                f"dst/rank{rank}/max_density": 1.0 if first.max_density is None else first.max_density,
                f"dst/rank{rank}/density_scale": 1.0 if first.density_scale is None else first.density_scale,
                f"dst/rank{rank}/density": report.mean_density,
                f"dst/rank{rank}/estimated_recall": report.mean_estimated_recall,
                f"dst/rank{rank}/speed": cost_model.speed(rank),
            })
            if report.recall is not None:
                logs[f"dst/rank{rank}/recall"] = report.recall
            recall = report.mean_estimated_recall if report.recall is None else report.recall
            self._epoch_recall.append((float(sum(record.lengths)), recall))
        self._epoch_measured.append(observation.measured)
        _log(pl_module, logs)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._epoch_measured:
            return
        tokens, recall = np.array(self._epoch_recall).T
        epoch = {
            "dst/balance_efficiency": balance_efficiency(self._epoch_measured),
            "dst/mean_recall": float((tokens * recall).sum() / max(tokens.sum(), 1.0)),
        }
        # The same on every rank already; sync_dist only tells Lightning so.
        for name, value in epoch.items():
            pl_module.log(name, float(value), on_step=False, on_epoch=True, batch_size=1, sync_dist=True)

    # ---------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        if self.controller is None:  # not fitted yet: keep what was loaded, if anything
            return dict(self._restored or {})
        return self.controller.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict) if state_dict else None


def _log(pl_module: L.LightningModule, values: dict[str, float]) -> None:
    for name, value in values.items():
        pl_module.log(name, float(value), on_step=True, on_epoch=False, batch_size=1)
