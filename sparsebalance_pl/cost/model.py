"""The cost model of a run: what documents and micro-batches cost on this hardware, learned from every step.

Sparsity-aware batching balances predicted document costs and dynamic sparsity tuning moves budgets by
predicted step times; both must agree with each other and with the hardware. So one object holds everything
those predictions come from:

- the latency model: a profiled table or the analytic prior, with its online calibration;
- the density estimator: each document's attention density at the base budget, by length (None for dense
  attention, where every document is dense);
- per-rank speeds: how much slower or faster a rank's attention runs than predicted for the same work
  (another GPU model, a throttled or shared device);
- the ring's communication (``RingCost``): what a rank of a context-parallel group waits for on the ring
  beyond its own compute;
- recall prices (``RecallPrices``): what recall a move of density costs or buys, by the length of the documents,
  which dynamic sparsity tuning's adaptive anchor weighs against time.

It is built once per run, by the model's ``SparseAttention``, and handed explicitly to whoever predicts with it
(the data module's ``connect``; the DST callback reads the module's ``sparse_attention``). It learns from every training step: each rank's ``StepRecord`` (its documents,
what its selection kept and how long its attention calls took) is gathered from every rank, and ``observe``
folds them in rank order. Every rank then holds the same state, so the checkpoint rank 0 writes resumes every
rank. The object never communicates itself.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from sparsebalance_pl.balance import imbalance
from sparsebalance_pl.cost.density import DensityEstimator
from sparsebalance_pl.cost.latency import TERMS, UNCALIBRATED_ERROR, LatencyModel
from sparsebalance_pl.cost.recall import RecallPrices
from sparsebalance_pl.cost.ring import RingCost
from sparsebalance_pl.distributed import gather_objects

log = logging.getLogger(__name__)

#: The latency-model terms that ``SparsityReport.attention_seconds`` covers: block selection + attention core
#: (what ``SparseAttention`` times); the others are learned only from whole forward and backward passes.
TIMED_TERMS = ("attention", "selection")
_TIMED = np.array([name in TIMED_TERMS for name in TERMS], dtype=np.float64)
#: The terms attention timing leaves out (projections, MLP, head, fixed costs): learned only where a rank's whole
#: forward and backward is timed free of collectives (``observe``'s ``whole_seconds``).
UNTIMED_TERMS = tuple(name for name in TERMS if name not in TIMED_TERMS)
#: One step changes no rank's prediction of a timed term (the term's calibrated scale times the rank's speed) by
#: more than this factor: a prior that is far off converges over a few steps instead of swinging every
#: prediction (and DST's anchor) at once.
MAX_STEP_CORRECTION = 2.0


@dataclass(frozen=True)
class SparsityReport:
    """What one training micro-batch's forward and backward did on one rank, as host numbers.

    Attributes:
        density: per attention layer, kept fraction of causal tiles at the budget in use (1.0 when dense).
        estimated_recall: per attention layer, the selection's estimated share of attention mass kept.
        base_document_density: per document of the micro-batch, the density (mean over layers) it would have
            had at the base budgets, from the same ranking: what predicts the cost of later batches.
        attention_seconds: measured seconds of selection + attention core (``TIMED_TERMS``), forward and
            backward, free of collectives (``sparsebalance_pl.timing.AttentionTimer``) but for the ring's.
        recall: exact recall on sampled rows (mean over layers) when the module measures it, else None.
        ring_seconds: the part of ``attention_seconds`` spent waiting on ring transfers under context
            parallelism (0 without): what the compute did not hide, and waits on a slower group member.
        base_density, base_estimated_recall: per attention layer, the density and estimated recall the base
            budget would have given, from the same ranking (``BudgetedSelection.base_stats``): against
            ``density`` and ``estimated_recall`` they are what a moved budget bought or cost, which DST's
            adaptive anchor learns from. None when not reported (it then keeps its prior).
        base_recall: the exact recall the base budget would have given on the same sampled rows as ``recall``
            (equal to it when the budget did not move); what prices a move where recall is measured.
        probe_moves: where recall is measured, (density, exact recall) of each price probe (a cut and a raise
            of the base budget, ``sparsebalance_pl.attention.price_probes``) minus the base budget's, mean over
            layers: what DST's adaptive anchor learns its prices from on every step, moved or not.
        measurement_seconds: seconds spent measuring that recall, forward, outside ``attention_seconds``: the
            run's own instrumentation, which a run without ``recall_rows`` does not pay (0 without it);
            emulated ranks leave it out of a rank's time.
    """

    density: list[float]
    estimated_recall: list[float]
    base_document_density: list[float]
    attention_seconds: float
    recall: float | None = None
    ring_seconds: float = 0.0
    base_density: list[float] | None = None
    base_estimated_recall: list[float] | None = None
    base_recall: float | None = None
    probe_moves: list[tuple[float, float]] | None = None
    measurement_seconds: float = 0.0

    @property
    def mean_density(self) -> float:
        return sum(self.density) / len(self.density)

    @property
    def mean_estimated_recall(self) -> float:
        return sum(self.estimated_recall) / len(self.estimated_recall)

    def moved(self) -> tuple[float, float] | None:
        """(density, recall) at the budget used minus at the base budget, mean over layers; the recall exact on
        the sampled rows where both were measured, else estimated. None when the base figures were not
        reported. (The selection's estimate misprices moves, so the exact figure is preferred.)"""
        if self.base_density is None:
            return None
        density = self.mean_density - sum(self.base_density) / len(self.base_density)
        if self.recall is not None and self.base_recall is not None:
            return density, self.recall - self.base_recall
        if self.base_estimated_recall is None:
            return None
        return density, self.mean_estimated_recall - sum(self.base_estimated_recall) / len(self.base_estimated_recall)

    def priced_moves(self) -> list[tuple[float, float, float]]:
        """Every move of density this report prices against its base budget, as (base density, density moved,
        recall gained): the budget used (``moved``) and the price probes."""
        if self.base_density is None:
            return []
        base = sum(self.base_density) / len(self.base_density)
        moved = self.moved()
        return [(base, *move) for move in ([] if moved is None else [moved]) + list(self.probe_moves or ())]


@dataclass(frozen=True)
class StepRecord:
    """One rank's training micro-batch: its documents' lengths, what attention did with them, and the share of
    the documents' work the rank did (``1 / W`` when a context-parallel group of W ranks shared the stream)."""

    lengths: list[int]
    report: SparsityReport
    share: float = 1.0


@dataclass(frozen=True)
class StepObservation:
    """One step as ``CostModel.observe`` saw it: every rank's record (rank order), the timed seconds the model
    predicted for each rank before it learned from them (of which ``ring_predicted`` the ring's waits), beside the
    measured ones, and each rank's whole forward and backward where it was timed (``observe``'s
    ``whole_seconds``; None otherwise): all a replay of the step into another cost model needs."""

    records: list[StepRecord]
    predicted: np.ndarray
    measured: np.ndarray
    ring_predicted: np.ndarray
    whole_seconds: list[float] | None = None

    @property
    def measured_imbalance(self) -> float:
        return imbalance(self.measured)

    def replay_dict(self) -> dict[str, Any]:
        """The records and whole seconds as JSON-able data (``CostModel.replay`` learns from it again)."""
        records = [{"lengths": r.lengths, "share": r.share, "report": asdict(r.report)} for r in self.records]
        return {"records": records, "whole_seconds": self.whole_seconds}


def _group_size(share: float) -> int:
    """W of a rank that did ``share`` = 1 / W of its documents' work."""
    return max(1, round(1.0 / share))


class CostModel:
    """Predicted seconds of documents and micro-batches, corrected from every measured step (module docstring).

    ``error`` is the typical relative error (as |log(measured / predicted)|) of its recent predictions of the
    ranks' attention times, made before each step: what DST takes for the noise of its predictions.
    ``step_overhead`` is the measured seconds a step costs beyond its micro-batches (the optimiser step), which
    sparsity-aware batching weighs against balance. ``ring`` is the ring's communication under context
    parallelism (``RingCost``, built from the latency table's model dimensions and dtype).

    Args:
        latency: the latency model (``LatencyModel.from_file``, the profiler, or ``LatencyModel.analytic``).
        density: the density estimator for sparse attention; None when attention is dense.
        speed_smoothing: weight of each new measurement in a rank's speed, in (0, 1].
        warmup_steps: the first ``observe`` calls of each process (one per micro-batch round, so per optimiser
            step only without gradient accumulation) teach densities but no times: they run slower
            (lazy initialisation, allocator growth, first kernel launches; measured 1.4-2x in the worked
            example), and learning from them moved predictions, and DST's anchor, by up to 2x and back.
    """

    def __init__(
        self,
        latency: LatencyModel,
        density: DensityEstimator | None = None,
        *,
        speed_smoothing: float = 0.3,
        warmup_steps: int = 1,
    ) -> None:
        if not 0.0 < speed_smoothing <= 1.0:
            raise ValueError(f"speed_smoothing={speed_smoothing} must lie in (0, 1]")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
        self.density = density
        self.ring = RingCost.for_model(latency.table.meta.dims, latency.table.meta.dtype)
        self.recall_prices = RecallPrices()
        self.speed_smoothing = speed_smoothing
        self.warmup_left = warmup_steps  # per process: not checkpointed, a resumed process warms up again
        self.log_speeds = np.zeros(0)
        self.steps_observed = 0
        self.latency = latency
        self.step_overhead = 0.0
        self.overheads_observed = 0
        self.last_step: StepObservation | None = None

    @property
    def latency(self) -> LatencyModel:
        return self._latency

    @latency.setter
    def latency(self, model: LatencyModel) -> None:
        """A new latency model (a profiled table in place of the prior); before any step was measured, ``error``
        starts from what the model expects of itself (``LatencyModel.prior_error``)."""
        self._latency = model
        if self.steps_observed == 0:
            self.error = model.prior_error

    # ------------------------------------------------------------------------------------------ predicting
    def document_density(self, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        """Each document's estimated density at the base budget (1.0 for dense attention)."""
        n = np.maximum(np.asarray(lengths, dtype=np.float64), 1.0)
        return self.density(n) if self.density is not None else np.ones_like(n)

    def document_costs(self, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        """Predicted seconds each document adds to a micro-batch at its estimated density: what sparsity-aware
        batching balances. The same on every rank (every rank's cost model learned the same records), so a plan
        each rank computes alone from them is the same plan."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.latency.doc_costs(lengths, self.document_density(lengths))

    def speed(self, rank: int) -> float:
        """How many times slower than predicted ``rank``'s attention runs (1.0 before any measurement)."""
        return math.exp(self.log_speeds[rank]) if rank < self.log_speeds.size else 1.0

    def for_rank(self, rank: int, share: float = 1.0) -> LatencyModel:
        """The latency model as it holds for ``rank``: its timed terms (attention, selection) scaled by its speed,
        and every term by ``share``, the part of its documents' work the rank does (``1 / W`` of a stream
        block-striped over a context-parallel group of W ranks: 1/W of every document's rows, tiles and
        tokens), plus, in a group, the ring's communication (the term ``"ring"``)."""
        calibration = self.latency.calibration
        log_scales = calibration.log_scales + math.log(self.speed(rank)) * _TIMED + math.log(share)
        group_size = _group_size(share)
        ring = (lambda tokens: self.ring.seconds(tokens, group_size)) if group_size > 1 else None
        return LatencyModel(self.latency.table, replace(calibration, log_scales=log_scales), ring=ring)

    def group_document_costs(self, lengths: Sequence[int] | np.ndarray, group_size: int) -> np.ndarray:
        """Predicted seconds of each document shared as one stream by a context-parallel group of ``group_size``
        ranks, summed over the ranks: its work (1 / W on each rank) plus every rank's wait on the ring for its
        tokens (each document counted as if its stream held it alone). Over W, a rank's time."""
        lengths = np.asarray(lengths, dtype=np.float64)
        ring = np.array([self.ring.seconds(n, group_size) for n in lengths])
        return self.document_costs(lengths) + group_size * ring

    def timed_seconds(self, lengths: Sequence[int], density: float) -> float:
        """Predicted seconds of the timed terms (what ``SparsityReport.attention_seconds`` measures but for the
        ring's waits) at the nominal speed."""
        return timed_seconds(self.latency, lengths, density)

    # ------------------------------------------------------------------------------------------- learning
    def observe(self, records: Sequence[StepRecord], whole_seconds: Sequence[float] | None = None) -> StepObservation:
        """Learn from one step's records, one per rank in rank order (the same list on every rank).

        Each rank's speed follows its measured over predicted attention compute (its time less its ring waits)
        relative to the other ranks'; the latency model is calibrated on each rank's compute at the nominal
        speed (a term's scale and a rank's speed together moving by at most ``MAX_STEP_CORRECTION`` per step;
        its forgetting applied once for the step, so its memory counts steps whatever the number of ranks);
        the ring's cost learns from each context-parallel group's least wait; the density estimator learns each
        document's density at the base budget and the recall prices each pack's priced moves
        (``observe_attention``); ``error`` follows how far the predictions made before this step were off. Times
        of the first ``warmup_steps`` calls are left out.

        ``whole_seconds``: each rank's whole forward and backward, where it is timed free of collectives
        (emulated ranks run one after another; under FSDP a fast rank's time includes waiting for the slowest,
        so a real run passes None): the time beyond the attention calls teaches ``UNTIMED_TERMS`` too.
        """
        records = list(records)
        if len(records) != self.log_speeds.size:
            if self.log_speeds.size:
                log.warning("rank speeds were learned for %d ranks, this run has %d: they restart",
                            self.log_speeds.size, len(records))
            self.log_speeds = np.zeros(len(records))
        nominal = np.array([self.timed_seconds(r.lengths, r.report.mean_density) * r.share for r in records])
        ring = np.array([self.ring.seconds(sum(r.lengths), _group_size(r.share)) for r in records])
        predicted = nominal * np.exp(self.log_speeds) + ring
        measured = np.array([r.report.attention_seconds for r in records], dtype=np.float64)
        compute = measured - np.array([r.report.ring_seconds for r in records], dtype=np.float64)
        valid = np.isfinite(compute) & (compute > 0) & (nominal > 0)
        if self.warmup_left > 0:
            self.warmup_left -= 1
            valid[:] = False
        if valid.any():
            self.track_error(np.abs(np.log(measured[valid] / predicted[valid])))
        speeds_before = self.log_speeds.copy()
        if valid.all():
            relative = np.log(compute / nominal)
            self.log_speeds += self.speed_smoothing * ((relative - relative.mean()) - self.log_speeds)
        calibration = self.latency.calibration
        before = calibration.log_scales.copy()
        for rank, record in enumerate(records):
            if valid[rank]:
                seconds = compute[rank] / (self.speed(rank) * record.share)  # the whole documents' time
                density = record.report.mean_density
                self.latency.observe(record.lengths, density, seconds, terms=TIMED_TERMS, forget=False)
                rest = math.nan if whole_seconds is None else (whole_seconds[rank] - measured[rank]) / record.share
                if rest > 0 and math.isfinite(rest):
                    self.latency.observe(record.lengths, density, rest, terms=UNTIMED_TERMS, forget=False)
        self.observe_attention(records)
        if valid.any():  # the ranks' micro-batches of a step are one round of measurements
            calibration.forget()
        self._bound_correction(before, speeds_before)
        if valid.all():
            self._observe_ring(records)
        whole = None if whole_seconds is None else [float(x) for x in whole_seconds]
        self.last_step = StepObservation(records, predicted, measured, ring, whole)
        return self.last_step

    def replay(self, step: Mapping[str, Any]) -> StepObservation:
        """``observe`` a step saved by ``StepObservation.replay_dict``, as if it were measured now."""
        records = [StepRecord(r["lengths"], SparsityReport(**r["report"]), r["share"]) for r in step["records"]]
        return self.observe(records, whole_seconds=step["whole_seconds"])

    def _observe_ring(self, records: Sequence[StepRecord]) -> None:
        """Each context-parallel group (W neighbouring ranks that each did 1 / W) teaches the ring's cost its
        least wait: the one rank that waited on no slower member waited on communication alone."""
        for first in range(len(records)):
            size = _group_size(records[first].share)
            if size == 1 or first % size:
                continue
            group = records[first : first + size]
            if len(group) == size and all(r.share == group[0].share and r.lengths == group[0].lengths for r in group):
                self.ring.observe(sum(group[0].lengths), size, min(r.report.ring_seconds for r in group))

    def _bound_correction(self, scales_before: np.ndarray, speeds_before: np.ndarray) -> None:
        """No rank's timed terms move by more than ``MAX_STEP_CORRECTION`` in one step, a term's scale and the
        rank's speed together: each term's scale first, then each speed within what its scales left."""
        bound = math.log(MAX_STEP_CORRECTION)
        calibration = self.latency.calibration
        scale_moves = np.clip(calibration.log_scales - scales_before, -bound, bound)
        calibration.log_scales = scales_before + scale_moves
        timed = scale_moves[_TIMED > 0]
        speed_moves = np.clip(self.log_speeds - speeds_before, -bound - timed.min(), bound - timed.max())
        self.log_speeds = speeds_before + speed_moves

    def track_error(self, step_errors: np.ndarray) -> None:
        """``error`` learns one step's |log(measured / predicted)| per rank (``observe`` calls it; a simulation
        without measurements may too): a running mean of the step's median, the uncalibrated start
        counting as one step, then an average over about the last three steps (it must follow a calibration
        that converges within a few steps)."""
        self.steps_observed += 1
        weight = max(1.0 / (self.steps_observed + 1), 1.0 / 3.0)
        self.error += weight * (float(np.median(step_errors)) - self.error)

    def observe_step_overhead(self, seconds: float) -> None:
        """Learn the step overhead from one optimiser step's measured seconds (the same on every rank: the
        slowest rank's). A process's first is left out: it allocates the optimiser's state."""
        self.overheads_observed += 1
        if self.overheads_observed == 1 or not math.isfinite(seconds) or seconds < 0:
            return
        weight = max(1.0 / (self.overheads_observed - 1), self.speed_smoothing)
        self.step_overhead += weight * (seconds - self.step_overhead)

    def observe_attention(self, records: Sequence[StepRecord]) -> None:
        """Learn what attention did apart from its time: each document's density at the base budget, and each
        pack's recall prices. ``observe`` calls it for every step; a calibration pass outside training calls it
        alone, which teaches no times."""
        for record in records:  # one record at a time, as the estimator's running means were learned before
            docs = [(n, d) for n, d in zip(record.lengths, record.report.base_document_density) if n > 0]
            if self.density is not None and docs:
                self.density.observe([n for n, _ in docs], [d for _, d in docs])
        self.recall_prices.observe([(r.lengths, r.report.priced_moves()) for r in records])

    # ---------------------------------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        return {
            "latency": self.latency.state_dict(),
            "density": None if self.density is None else self.density.state_dict(),
            "log_speeds": self.log_speeds.tolist(),
            "error": self.error,
            "steps_observed": self.steps_observed,
            "step_overhead": self.step_overhead,
            "ring": self.ring.state_dict(),
            "recall_prices": self.recall_prices.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.latency.load_state_dict(state["latency"])
        if self.density is not None and state.get("density") is not None:
            self.density.load_state_dict(state["density"])
        self.log_speeds = np.asarray(state.get("log_speeds", []), dtype=np.float64)
        self.error = float(state.get("error", UNCALIBRATED_ERROR))
        self.steps_observed = int(state.get("steps_observed", 0))
        self.step_overhead = float(state.get("step_overhead", 0.0))
        self.ring.load_state_dict(state.get("ring", {}))
        self.recall_prices.load_state_dict(state.get("recall_prices", {}))


def timed_seconds(model: LatencyModel, lengths: Sequence[int], density: float) -> float:
    """``model``'s predicted seconds of the timed terms (``TIMED_TERMS``, and the ring's waits of a rank of a
    context-parallel group) of a micro-batch: what ``SparsityReport.attention_seconds`` measures."""
    parts = model.breakdown(lengths, density)
    return sum(parts[name] for name in (*TIMED_TERMS, "ring"))


def observe_step(
    cost_model: CostModel, lengths: Sequence[int], report: SparsityReport, group=None, share: float = 1.0
) -> StepObservation:
    """Gather every rank's record of the training micro-batch just done (one all-gather of a few numbers per
    rank) and let ``cost_model`` learn from them; call it on every rank after the backward. ``share``: the part
    of the documents' work this rank did (``1 / W`` of a stream shared by a context-parallel group of W)."""
    record = StepRecord([int(n) for n in lengths], report, float(share))
    return cost_model.observe(gather_objects(record, group))
