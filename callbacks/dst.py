"""Dynamic sparsity tuning (DST): balance ranks step by step by moving attention budgets toward an anchor time.

Before each training micro-batch every rank predicts its time at the base budget (latency model x its own
speed, with document densities estimated from earlier batches) and the ranks exchange five numbers each in
one all-gather; all pick the same anchor and each sets its own budgets (``callbacks.budget``). After the
backward the ranks exchange what happened (documents, densities, recall, and the measured time of the
attention calls, which no collective distorts) in one more all-gather, and every rank folds the same
observations, in rank order, into the latency model's calibration, the per-rank speeds, the density
estimator and the recall trade-off: the state stays identical on all ranks, so the checkpoint written by
rank 0 resumes every rank. Nothing communicates inside the layers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics.aggregation import MeanMetric, SumMetric

from sparsebalance_pl.attention import LayerBudget
from sparsebalance_pl.balance import imbalance
from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.strategy import gather_objects
from sparsebalance_pl.callbacks.budget import (
    ANCHORS,
    Anchor,
    Outlook,
    RankBudget,
    adaptive_anchor,
    anchor_time,
    outlook,
    rank_budget,
    with_speed,
)
from sparsebalance_pl.callbacks.protocol import TIMED_TERMS, SparsityTunable
from sparsebalance_pl.datamodules.density import DensityEstimator
from sparsebalance_pl.latency import LatencyModel


class RecallSlope:
    """Recall gained per unit of density, fitted to the (density, estimated recall) pairs seen in training.

    Exponentially weighted least squares, shrunk toward ``prior`` while the observed densities barely
    spread; 1.0 (recall follows density, the near-uniform regime) is the cautious prior.
    """

    def __init__(self, prior: float = 1.0, decay: float = 0.95, prior_weight: float = 1e-3) -> None:
        self.prior, self.decay, self.prior_weight = prior, decay, prior_weight
        self.moments = np.zeros(5)  # weight, sum x, sum y, sum xx, sum xy

    def update(self, density: list[float], recall: list[float]) -> None:
        x, y = np.asarray(density, dtype=np.float64), np.asarray(recall, dtype=np.float64)
        self.moments = self.decay * self.moments + [len(x), x.sum(), y.sum(), (x * x).sum(), (x * y).sum()]

    @property
    def slope(self) -> float:
        n, sx, sy, sxx, sxy = self.moments
        if n <= 0:
            return self.prior
        var, cov = sxx / n - (sx / n) ** 2, sxy / n - sx * sy / n**2
        return float((cov + self.prior * self.prior_weight) / (max(var, 0.0) + self.prior_weight))

    def state_dict(self) -> dict[str, Any]:
        return {"moments": self.moments.tolist()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.moments = np.asarray(state["moments"], dtype=np.float64)


@dataclass
class _Pending:
    """What this rank decided before the forward, kept until its backward is done."""

    lengths: list[int]
    views: list[Outlook]
    anchor: float
    budget: RankBudget


class DynamicSparsityTuning(Callback):
    """Moves each rank's sparse-attention budget so its predicted step time approaches a common anchor.

    Works with any LightningModule implementing ``sparsebalance_pl.callbacks.protocol.SparsityTunable``.
    With ``p=0`` budgets stay at the base (the static baseline) while calibration and logging still run.

    Args:
        anchor: ``mean`` (default), ``median``, ``min``, ``max`` of the ranks' predicted times at the base
            budget, or ``adaptive``: the fixed anchor with the shortest predicted step whose predicted
            token-weighted recall loss, from the recall-per-density slope observed so far, stays within
            ``recall_tolerance``.
        p: largest move of tau away from the base budget, in [0, 1]. The kept tiles scale with the latency
            model so that no rank passes the anchor time: a straggler's scale brings it down to the anchor (no
            lower than ``min_density``), a fast rank's stops it there (``callbacks.budget``).
        min_density: the lowest density a straggler aims at, in [0, 1] (the latency model's smallest
            profiled density when lower): a floor under the time-for-recall trade.
        recall_tolerance: the adaptive anchor's allowance for predicted loss of mean recall.
        speed_smoothing: weight of each new measurement in a rank's speed (its measured over predicted
            attention time relative to the other ranks), in (0, 1].
        slowdown: test option, rank -> factor: that rank's attention is made ``factor`` times slower (a
            sleep after its backward, proportional to its measured attention time and counted in it).

    Logged per step (the same on every rank): ``dst/anchor_s``, ``dst/predicted_imbalance_base`` and
    ``dst/predicted_imbalance`` (whole step, base and chosen budgets), ``dst/measured_imbalance`` (attention
    calls), and per rank ``dst/rank{r}/{predicted_base_s,predicted_s}`` (whole step),
    ``dst/rank{r}/{tau,max_density,density_scale,density,estimated_recall,recall,speed}`` and
    ``latency/rank{r}/{predicted_s,measured_s}`` (attention calls). Per epoch: ``dst/balance_efficiency``
    (sum of mean over sum of max measured attention time) and ``dst/mean_recall`` (token-weighted).
    """

    def __init__(
        self,
        anchor: Anchor = "mean",
        p: float = 0.1,
        min_density: float = 0.05,
        recall_tolerance: float = 0.02,
        speed_smoothing: float = 0.3,
        slowdown: dict[int, float] | None = None,
    ) -> None:
        name = type(self).__name__
        if anchor not in ANCHORS:
            raise ConfigError(f"{name}.anchor={anchor!r} is unknown; allowed: {', '.join(ANCHORS)}")
        if not 0.0 <= p <= 1.0:
            raise ConfigError(f"{name}.p={p} must lie in [0, 1]")
        if not 0.0 <= min_density <= 1.0:
            raise ConfigError(f"{name}.min_density={min_density} must lie in [0, 1]")
        if not 0.0 <= recall_tolerance <= 1.0:
            raise ConfigError(f"{name}.recall_tolerance={recall_tolerance} must lie in [0, 1]")
        if not 0.0 < speed_smoothing <= 1.0:
            raise ConfigError(f"{name}.speed_smoothing={speed_smoothing} must lie in (0, 1]")
        if any(f < 1.0 for f in (slowdown or {}).values()):
            raise ConfigError(f"{name}.slowdown factors must be >= 1, got {slowdown}")
        self.anchor, self.p, self.min_density = anchor, p, min_density
        self.recall_tolerance = recall_tolerance
        self.speed_smoothing = speed_smoothing
        self.slowdown = {int(r): float(f) for r, f in (slowdown or {}).items()}
        self.recall_slope = RecallSlope()
        self.latency: LatencyModel | None = None
        self.density: DensityEstimator | None = None
        self.log_speeds: np.ndarray = np.zeros(1)
        self.shifts: list[float | None] = [None]
        self.budgets: list[list[list[float | None]]] = []  # [rank][layer] = [tau, max_density]
        self._restored: dict[str, Any] | None = None
        self._pending: _Pending | None = None
        self._efficiency = (SumMetric(sync_on_compute=False), SumMetric(sync_on_compute=False))
        self._recall = MeanMetric(sync_on_compute=False)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(anchor=self.anchor, p=self.p)

    # ------------------------------------------------------------------------------------------ set-up
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not isinstance(pl_module, SparsityTunable):
            raise TypeError(
                f"DynamicSparsityTuning needs a LightningModule implementing SparsityTunable "
                f"(sparsebalance_pl.callbacks.protocol); {type(pl_module).__name__} does not"
            )

    def on_fit_start(self, trainer: L.Trainer, pl_module: SparsityTunable) -> None:
        model = pl_module.latency_model
        if model is None:
            raise RuntimeError(f"{type(pl_module).__name__}.latency_model is None at fit start (SparsityTunable)")
        self.latency = model
        world = trainer.world_size
        self.density = pl_module.density_estimator
        self.log_speeds, self.shifts = np.zeros(world), [None] * world
        state, self._restored = self._restored, None
        if state is None:
            return
        model.load_state_dict(state["latency"])
        self.density.load_state_dict(state["density"])
        self.recall_slope.load_state_dict(state["recall_slope"])
        if len(state["log_speeds"]) != world:
            rank_zero_warn(f"DST state is from {len(state['log_speeds'])} ranks, this run has {world}: ranks restart")
            return
        self.log_speeds, self.shifts = np.asarray(state["log_speeds"]), list(state["shifts"])
        self.budgets = state["budgets"]
        if self.budgets:
            pl_module.layer_budgets = _budgets_from(self.budgets[trainer.global_rank])

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for metric in (*self._efficiency, self._recall):
            metric.reset()

    # ----------------------------------------------------------------------------------- before a step
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: SparsityTunable, batch: Any, batch_idx: int) -> None:
        rank, model = trainer.global_rank, self.latency
        lengths = [int(n) for n in pl_module.document_lengths(batch)]
        mine = with_speed(model, math.exp(self.log_speeds[rank]))
        base_density = self.density([max(n, 1) for n in lengths])
        view = outlook(mine, lengths, base_density, self.p, self.min_density)
        views = [Outlook(*row) for row in _gather_floats(trainer, pl_module, view.to_list())]
        times = [v.base for v in views]
        if self.anchor == "adaptive":
            name, anchor = adaptive_anchor(views, self.p, self.recall_slope.slope, self.recall_tolerance)
            _log(pl_module, {"dst/adaptive_anchor": ("min", "median", "mean", "max").index(name)})
        else:
            anchor = anchor_time(times, self.anchor)
        budget = rank_budget(mine, lengths, view, anchor, self.p, pl_module.base_budgets, self.shifts[rank])
        pl_module.layer_budgets = budget.budgets
        self._pending = _Pending(lengths, views, anchor, budget)
        chosen = times if self.p <= 0 else [v.at(anchor) for v in views]
        logs = {
            "dst/anchor_s": anchor,
            "dst/predicted_imbalance_base": imbalance(times),
            "dst/predicted_imbalance": imbalance(chosen),
        }
        for r, (base, moved) in enumerate(zip(times, chosen)):
            logs.update({f"dst/rank{r}/predicted_base_s": base, f"dst/rank{r}/predicted_s": moved})
        _log(pl_module, logs)

    # ------------------------------------------------------------------------------------ after a step
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: SparsityTunable, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        pending, self._pending = self._pending, None
        report = pl_module.sparsity_report()
        record = None
        if pending is not None and report is not None:
            measured = report.attention_seconds
            factor = self.slowdown.get(trainer.global_rank, 1.0)
            if factor > 1.0:
                time.sleep((factor - 1.0) * measured)
                measured *= factor
            record = {
                "lengths": pending.lengths,
                "density": report.mean_density,
                "estimated_recall": report.mean_estimated_recall,
                "recall": report.recall,
                "base_document_density": report.base_document_density,
                "measured": measured,
                "shift": pending.budget.shift,
                "budgets": [[b.tau, b.max_density, b.density_scale] for b in pending.budget.budgets],
            }
        records = gather_objects(trainer, record)
        if any(r is None for r in records):
            return
        self._learn(pl_module, records)

    def _learn(self, pl_module: L.LightningModule, records: list[dict]) -> None:
        """Fold every rank's observation into the shared state, in rank order (identical on all ranks)."""
        model = self.latency
        predicted = np.array([_timed_seconds(model, r["lengths"], r["density"]) for r in records])
        measured = np.array([r["measured"] for r in records])
        logs: dict[str, float] = {"dst/measured_imbalance": imbalance(measured)}
        for rank, r in enumerate(records):
            logs[f"latency/rank{rank}/predicted_s"] = predicted[rank] * math.exp(self.log_speeds[rank])
            logs[f"latency/rank{rank}/measured_s"] = r["measured"]
        relative = np.log(measured / predicted)
        self.log_speeds += self.speed_smoothing * ((relative - relative.mean()) - self.log_speeds)
        for rank, r in enumerate(records):
            nominal = r["measured"] / math.exp(self.log_speeds[rank])
            model.observe(r["lengths"], r["density"], nominal, terms=TIMED_TERMS)
            docs = [(n, d) for n, d in zip(r["lengths"], r["base_document_density"]) if n > 0]
            self.density.observe([n for n, _ in docs], [d for _, d in docs])
            tau, cap, scale = r["budgets"][0]
            logs.update({
                f"dst/rank{rank}/tau": tau,
                f"dst/rank{rank}/max_density": 1.0 if cap is None else cap,
                f"dst/rank{rank}/density_scale": 1.0 if scale is None else scale,
                f"dst/rank{rank}/density": r["density"],
                f"dst/rank{rank}/estimated_recall": r["estimated_recall"],
                f"dst/rank{rank}/speed": math.exp(self.log_speeds[rank]),
            })
            if r["recall"] is not None:
                logs[f"dst/rank{rank}/recall"] = r["recall"]
        self.recall_slope.update([r["density"] for r in records], [r["estimated_recall"] for r in records])
        self.shifts = [r["shift"] for r in records]
        self.budgets = [r["budgets"] for r in records]
        tokens = np.array([sum(r["lengths"]) for r in records], dtype=np.float64)
        recall = np.array([r["estimated_recall"] if r["recall"] is None else r["recall"] for r in records])
        self._efficiency[0].update(float(measured.mean()))
        self._efficiency[1].update(float(measured.max()))
        self._recall.update(torch.from_numpy(recall), torch.from_numpy(tokens))
        _log(pl_module, logs)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        mean_sum, max_sum = (float(m.compute()) for m in self._efficiency)
        if max_sum <= 0:
            return
        epoch = {"dst/balance_efficiency": mean_sum / max_sum, "dst/mean_recall": float(self._recall.compute())}
        _log(pl_module, epoch, on_epoch=True)

    # ---------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        if self.latency is None:  # not fitted yet: keep what was loaded, if anything
            return dict(self._restored or {})
        return {
            "latency": self.latency.state_dict(),
            "density": self.density.state_dict(),
            "recall_slope": self.recall_slope.state_dict(),
            "log_speeds": self.log_speeds.tolist(),
            "shifts": list(self.shifts),
            "budgets": self.budgets,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict) if state_dict else None


def _budgets_from(rows: list) -> list[LayerBudget]:
    """Checkpointed [tau, max_density, density_scale] rows (two fields before density_scale existed)."""
    return [LayerBudget(*(None if x is None else float(x) for x in row)) for row in rows]


def _timed_seconds(model: LatencyModel, lengths: list[int], density: float) -> float:
    """Predicted seconds of the terms the module times (selection + attention core)."""
    parts = model.breakdown(lengths, density)
    return sum(parts[name] for name in TIMED_TERMS)


def _gather_floats(trainer: L.Trainer, pl_module: L.LightningModule, values: list[float]) -> np.ndarray:
    """[world, len(values)]: one all-gather of a few floats."""
    tensor = torch.tensor(values, dtype=torch.float64, device=pl_module.device)
    return trainer.strategy.all_gather(tensor).reshape(trainer.world_size, -1).cpu().numpy()


def _log(pl_module: L.LightningModule, values: dict[str, float], on_epoch: bool = False) -> None:
    for name, value in values.items():
        pl_module.log(name, float(value), on_step=not on_epoch, on_epoch=on_epoch, batch_size=1)
