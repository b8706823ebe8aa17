"""Predict one micro-batch's forward+backward time from its documents' lengths and attention densities.

Sparsity-aware batching and dynamic sparsity tuning both decide from predicted times,
so the prediction has to hold on the hardware at hand. The model, for one micro-batch on one rank, all
layers, forward and backward, plus LM head and loss::

    T = s_tok * N * (L*a + h)                 "tokens":    projections, MLP, norms per layer; head + loss
      + s_att * L * sum_i c(n_i, rho_i)       "attention": block-sparse attention core, one document
      + s_sel * L * e(N)                      "selection": block selection (independent of density)
      + s_fix * (L*d + d0)                    "overhead":  fixed per layer and per micro-batch
      + ring(N)                               "ring":      a context-parallel rank's waits (``cost.ring``)

with N = sum_i n_i tokens and L layers. c is a profiled table over (length, density), interpolated
log-log in length and linearly in density (attention is close to linear in kept tiles); e a profiled
curve over length. Selection scores the whole packed stream (``selection_scope="stream"``, quadratic in
N, as ``select_blocks`` does today) or each document on its own (``"document"``: sum_i e(n_i)); the
profiler measures which. The scales s start at 1 and are corrected online by ``observe`` (an extended Kalman
filter on their logarithms, so a table from other hardware or the analytic FLOP prior becomes accurate
after a few steps). Every table is made monotone in length and density on construction, so predictions
are too, and ``density_for`` can invert them exactly.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from sparsebalance_pl.errors import DataError
from sparsebalance_pl.kernels.selection import selection_options

log = logging.getLogger(__name__)

FORMAT = "sparsebalance-latency/1"
TERMS = ("tokens", "attention", "selection", "overhead")
#: The model dimensions that decide cost; a table profiled for other values is rejected.
_SCALARS = ("token_layer", "token_head", "layer_overhead", "model_overhead")
COST_DIMS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")

ArrayLike = Sequence[float] | np.ndarray | float
#: The typical |log(measured / predicted)| of a latency model before any step was measured, where its table does not
#: record its own (the analytic prior was off by a median 60% and up to 10x on modules it was not made for).
UNCALIBRATED_ERROR = 1.0


class LatencyTableError(DataError):
    """A latency table cannot be used (missing, corrupt, or profiled for another model); says which and why."""


class UnreachableTimeError(ValueError):
    """No density in [min density, 1] gives the requested time; ``density`` is the nearest bound."""

    def __init__(self, message: str, density: float) -> None:
        super().__init__(message)
        self.density = density


def cost_dims(dims: Any) -> dict[str, int]:
    """The cost-relevant dimensions of a ``sparsebalance_pl.model.ModelDims`` (or a mapping) as plain ints."""
    get = dims.get if isinstance(dims, Mapping) else lambda name: getattr(dims, name, None)
    values = {name: get(name) for name in COST_DIMS}
    if values["head_dim"] is None:
        values["head_dim"] = values["hidden_size"] // values["num_heads"]
    missing = [name for name, value in values.items() if value is None]
    if missing:
        raise ValueError(f"model dimensions lack {missing}")
    return {name: int(value) for name, value in values.items()}


@dataclass(frozen=True)
class TableMeta:
    """Where and for what a table was measured; compared on load so a stale table is never used silently."""

    dims: dict[str, int]
    block_size: int
    stride: int
    device: str = "unknown"
    dtype: str = "float32"
    versions: dict[str, str] = field(default_factory=dict)
    source: str = "profile"  # "profile" or "analytic"
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    notes: dict[str, Any] = field(default_factory=dict)
    #: the selection options its selection was timed with (``kernels.selection.SELECTION_OPTIONS`` keys; missing
    #: ones, as in every table from before the options, are the defaults)
    selection: dict[str, Any] = field(default_factory=dict)

    def mismatch(
        self, dims: Any, block_size: int | None = None, stride: int | None = None, selection: dict | None = None
    ) -> str | None:
        """Why this table does not fit the given model and kernel settings, or None when it does."""
        wanted = cost_dims(dims)
        diffs = [f"{k}: table {self.dims.get(k)} != model {v}" for k, v in wanted.items() if self.dims.get(k) != v]
        if block_size is not None and block_size != self.block_size:
            diffs.append(f"block_size: table {self.block_size} != run {block_size}")
        if stride is not None and stride != self.stride:
            diffs.append(f"stride: table {self.stride} != run {stride}")
        if selection is not None:
            run = selection_options(**selection)
            try:
                table = selection_options(**self.selection)
            except (TypeError, ValueError) as err:  # timed by another version of the selection
                diffs.append(f"selection options of the table: {err}")
            else:
                diffs += [f"selection {k}: table {table[k]!r} != run {run[k]!r}" for k in table if table[k] != run[k]]
        return "; ".join(diffs) or None


@dataclass
class LatencyTable:
    """Profiled (or analytic) seconds, per layer unless said otherwise; see the module docstring for the model.

    Attributes:
        lengths: document lengths of the grid (tokens, increasing, at least two).
        densities: densities of the grid (increasing, in (0, 1], ending at 1).
        attention: [len(lengths), len(densities)] forward+backward seconds of one layer's attention core on
            one document of that length with that fraction of its causal blocks kept.
        selection: [len(lengths)] seconds of one layer's block selection on a stream of one document.
        token_layer: seconds per token of one layer without its attention core (forward+backward).
        token_head: seconds per token of embedding, final norm, LM head and loss (forward+backward).
        layer_overhead: fixed seconds per layer and micro-batch.
        model_overhead: fixed seconds per micro-batch outside the layers.
        selection_scope: "stream" when selection cost follows the packed stream's total length,
            "document" when it is the sum over documents.
    """

    meta: TableMeta
    lengths: np.ndarray
    densities: np.ndarray
    attention: np.ndarray
    selection: np.ndarray
    token_layer: float
    token_head: float
    layer_overhead: float = 0.0
    model_overhead: float = 0.0
    selection_scope: str = "stream"

    def __post_init__(self) -> None:
        self.lengths = np.asarray(self.lengths, dtype=np.float64)
        self.densities = np.asarray(self.densities, dtype=np.float64)
        self.attention = np.asarray(self.attention, dtype=np.float64)
        self.selection = np.asarray(self.selection, dtype=np.float64)
        problem = self._problem()
        if problem:
            raise LatencyTableError(f"invalid latency table: {problem}")
        # Measurements are noisy; cost never falls with more tokens or more kept blocks.
        floor = 1e-12
        self.attention = np.maximum.accumulate(np.maximum.accumulate(np.maximum(self.attention, floor), 0), 1)
        self.selection = np.maximum.accumulate(np.maximum(self.selection, floor))

    def _problem(self) -> str | None:
        n, k = len(self.lengths), len(self.densities)
        if self.lengths.ndim != 1 or n < 2 or np.any(np.diff(self.lengths) <= 0) or self.lengths[0] < 1:
            return "lengths must be at least two increasing positive values"
        if self.densities.ndim != 1 or k < 2 or np.any(np.diff(self.densities) <= 0):
            return "densities must be at least two increasing values"
        if self.densities[0] <= 0 or self.densities[-1] != 1.0:
            return "densities must lie in (0, 1] and end at 1.0"
        if self.attention.shape != (n, k):
            return f"attention has shape {self.attention.shape}, expected {(n, k)}"
        if self.selection_scope not in ("stream", "document"):
            return f"selection_scope is {self.selection_scope!r}, expected 'stream' or 'document'"
        if self.selection.shape != (n,):
            return f"selection has shape {self.selection.shape}, expected {(n,)}"
        scalars = (self.token_layer, self.token_head, self.layer_overhead, self.model_overhead)
        values = np.concatenate([self.attention.ravel(), self.selection, np.asarray(scalars, dtype=np.float64)])
        if not np.all(np.isfinite(values)) or np.any(values < 0):
            return "times must be finite and non-negative"
        return None

    def scaled(self, factor: float | Sequence[float]) -> LatencyTable:
        """This table with its times multiplied by ``factor``: one number for all (a stand-in for other
        hardware), or one per term of ``TERMS`` (tokens, attention, selection, overhead)."""
        tokens, attention, selection, overhead = np.broadcast_to(np.asarray(factor, dtype=np.float64), len(TERMS))
        return replace(
            self,
            attention=self.attention * attention,
            selection=self.selection * selection,
            token_layer=self.token_layer * tokens,
            token_head=self.token_head * tokens,
            layer_overhead=self.layer_overhead * overhead,
            model_overhead=self.model_overhead * overhead,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "meta": asdict(self.meta),
            "lengths": self.lengths.tolist(),
            "densities": self.densities.tolist(),
            "attention": self.attention.tolist(),
            "selection": self.selection.tolist(),
            **{name: getattr(self, name) for name in _SCALARS},
            "selection_scope": self.selection_scope,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LatencyTable:
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise LatencyTableError(f"not a latency table of format {FORMAT!r} (found {found!r})")
        try:
            meta = TableMeta(**data["meta"])
            return cls(
                meta=meta,
                **{name: data[name] for name in ("lengths", "densities", "attention", "selection")},
                **{name: float(data[name]) for name in _SCALARS},
                selection_scope=data["selection_scope"],
            )
        except LatencyTableError:
            raise
        except (KeyError, TypeError, ValueError) as err:
            raise LatencyTableError(f"latency table is incomplete or malformed: {err!r}") from err


@dataclass
class OnlineCalibration:
    """Corrects the four term scales from measured times: an extended Kalman filter on their logarithms.

    Working on log scales keeps them positive and makes a common error (a table from slower hardware) a
    single direction that one observation corrects. The prior covariance is ``common**2 * 11^T +
    term**2 * I``: the whole table may be off by a factor, and each term on its own. ``forgetting`` < 1
    lets the fit follow drift (``forget``): after every observation by default, and once per step for a
    caller that learns all ranks' micro-batches of a step together, so its memory counts steps whatever the
    number of ranks. Residuals beyond ``huber`` times their running size are down-weighted so a
    single disturbed measurement (a busy machine) barely moves the fit. ``noise`` 0.1 is the scatter of
    step times on a shared CPU, and ``term`` 0.5 keeps each term within about 1.6x of the others a priori:
    with 0.05 and 1.0 two observations of similar batches swung one term far enough to push the held-out
    error from 7% to 20-70% before later steps pulled it back (``benchmarks/latency.py``).
    """

    forgetting: float = 0.95
    noise: float = 0.1
    common: float = 1.0
    term: float = 0.5
    huber: float = 3.0
    log_scales: np.ndarray = field(default_factory=lambda: np.zeros(len(TERMS)))
    cov: np.ndarray | None = None
    residual_size: float | None = None
    count: int = 0

    def __post_init__(self) -> None:
        self.log_scales = np.asarray(self.log_scales, dtype=np.float64)
        self.cov = self.prior_cov() if self.cov is None else np.asarray(self.cov, dtype=np.float64)

    def prior_cov(self) -> np.ndarray:
        n = len(TERMS)
        return self.common**2 * np.ones((n, n)) + self.term**2 * np.eye(n)

    @property
    def scales(self) -> np.ndarray:
        return np.exp(self.log_scales)

    def update(self, raw_terms: np.ndarray, seconds: float, forget: bool = True) -> None:
        """One observation: ``raw_terms`` are the unscaled term times of the batch, ``seconds`` the measured time;
        ``forget=False`` leaves the forgetting to a later ``forget`` call."""
        scaled = raw_terms * self.scales
        predicted = scaled.sum()
        if predicted <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        shares = scaled / predicted  # d log(predicted) / d log_scales
        residual = math.log(seconds / predicted)
        noise_var = self.noise**2
        if self.residual_size is not None and abs(residual) > self.huber * self.residual_size:
            noise_var *= abs(residual) / (self.huber * self.residual_size)
        gain = self.cov @ shares / (noise_var + shares @ self.cov @ shares)
        self.log_scales = np.clip(self.log_scales + gain * residual, -7.0, 7.0)
        cov = self.cov - np.outer(gain, shares @ self.cov)
        self.cov = 0.5 * (cov + cov.T)
        if forget:
            self.forget()
        size = max(abs(residual), self.noise)
        self.residual_size = size if self.residual_size is None else 0.8 * self.residual_size + 0.2 * size
        self.count += 1

    def forget(self) -> None:
        """Stabilised forgetting: the information measured so far decays by ``forgetting`` toward the prior's,
        ``P^-1 <- forgetting P^-1 + (1 - forgetting) P0^-1``. Directions the measurements excite follow drift;
        one they do not excite (per-token against per-micro-batch cost when every micro-batch holds about as
        many tokens) relaxes to its prior instead of growing past it, where one unusual batch would swing it."""
        information = self.forgetting * np.linalg.inv(self.cov)
        cov = np.linalg.inv(information + (1.0 - self.forgetting) * np.linalg.inv(self.prior_cov()))
        self.cov = 0.5 * (cov + cov.T)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(log_scales=self.log_scales.tolist(), cov=self.cov.tolist())
        return data


class LatencyModel:
    """Predicted forward+backward seconds of a micro-batch on one rank (public as
    ``sparsebalance_pl.latency.LatencyModel``).

    ``doc_lengths`` is a sequence of document lengths in tokens; ``density`` the kept fraction of each
    document's causal blocks, a scalar for all documents or one value per document, clipped to
    [``min_density``, 1]. ``ring``: for a rank of a context-parallel group, the seconds it waits on the
    group's ring over a micro-batch of N stream tokens (``CostModel.for_rank``); it adds the term ``"ring"``,
    which no density changes.
    """

    def __init__(
        self,
        table: LatencyTable,
        calibration: OnlineCalibration | None = None,
        ring: Callable[[float], float] | None = None,
    ) -> None:
        self.table = table
        self.calibration = calibration or OnlineCalibration()
        self.ring = ring
        self._log_lengths = np.log(table.lengths)
        self._log_attention = np.log(table.attention)
        self._log_selection = np.log(table.selection)

    # ----------------------------------------------------------------------------------------- prediction
    @property
    def prior_error(self) -> float:
        """The typical |log(measured / predicted)| to expect before any step was measured: for a table profiled on
        this machine for this model, how far its own repeated timings strayed from each other (``timing_spread``
        in its notes); otherwise ``UNCALIBRATED_ERROR``."""
        spread = self.table.meta.notes.get("timing_spread")
        return float(spread) if self.table.meta.source == "profile" and spread is not None else UNCALIBRATED_ERROR

    @property
    def min_density(self) -> float:
        return float(self.table.densities[0])

    @property
    def num_layers(self) -> int:
        return self.table.meta.dims["num_layers"]

    def doc_costs(self, lengths: ArrayLike, density: ArrayLike) -> np.ndarray:
        """Seconds each document adds to its micro-batch, for planners that add costs up.

        ``predict`` is their sum plus ``batch_cost`` of the micro-batch's token count (fixed overhead and,
        with stream-scoped selection, the selection cost); for ranks with similar token counts that part is
        nearly the same everywhere.
        """
        return self._doc_terms(lengths, density) @ self.calibration.scales[:3]

    def batch_cost(self, num_tokens: float) -> float:
        """Seconds of a micro-batch of ``num_tokens`` tokens that no single document accounts for."""
        return float(self._batch_terms(num_tokens) @ self.calibration.scales[2:])

    def predict(self, doc_lengths: ArrayLike, density: ArrayLike) -> float:
        """Forward+backward seconds of the whole model on one micro-batch (all layers, head and loss)."""
        return float(self._raw_terms(doc_lengths, density) @ self.calibration.scales) + self._ring(doc_lengths)

    def breakdown(self, doc_lengths: ArrayLike, density: ArrayLike) -> dict[str, float]:
        """Predicted seconds per term (see ``TERMS``, and ``"ring"``), for logging beside measured times."""
        parts = dict(zip(TERMS, (self._raw_terms(doc_lengths, density) * self.calibration.scales).tolist()))
        return {**parts, "ring": self._ring(doc_lengths)}

    def _ring(self, doc_lengths: ArrayLike) -> float:
        return 0.0 if self.ring is None else float(self.ring(float(_as_lengths(doc_lengths).sum())))

    def time_curve(self, doc_lengths: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """(densities, seconds): the predicted time at each of the table's densities, the same for every document.
        The prediction is piecewise linear in density between them, so these points hold it whole: interpolating
        them predicts any density and, the times rising with density, inverts any time exactly."""
        lengths = _as_lengths(doc_lengths)
        return self.table.densities, np.array([self.predict(lengths, d) for d in self.table.densities])

    def density_for(self, doc_lengths: ArrayLike, seconds: float, *, clip: bool = False) -> float:
        """The largest density (same for all documents) whose predicted time is at most ``seconds``.

        Exact (``time_curve``). When no density in [``min_density``, 1] reaches ``seconds``, raises
        ``UnreachableTimeError`` carrying the nearest bound, or returns that bound when ``clip`` is true.
        """
        densities, times = self.time_curve(doc_lengths)
        if not clip and seconds < times[0]:
            raise UnreachableTimeError(
                f"{seconds:.4g} s is below the fastest predicted time {times[0]:.4g} s "
                f"(density {densities[0]:g}) for these {len(_as_lengths(doc_lengths))} documents",
                float(densities[0]),
            )
        if not clip and seconds > times[-1] * (1 + 1e-9):
            raise UnreachableTimeError(
                f"{seconds:.4g} s is above the dense predicted time {times[-1]:.4g} s for these "
                f"{len(_as_lengths(doc_lengths))} documents",
                1.0,
            )
        return float(np.interp(seconds, times, densities))

    def _doc_terms(self, lengths: ArrayLike, density: ArrayLike) -> np.ndarray:
        """Unscaled [docs, 3] seconds over all layers: tokens, attention, document-scoped selection."""
        n = _as_lengths(lengths)
        rho = np.broadcast_to(np.asarray(density, dtype=np.float64), n.shape)
        if np.any(~np.isfinite(rho)) or np.any(rho <= 0):
            raise ValueError("densities must be positive and finite")
        t = self.table
        layers = self.num_layers
        present = n > 0
        idx, offset, width = _segments(self._log_lengths, np.log(np.maximum(n, 1.0)))
        rho = np.clip(rho, self.min_density, 1.0)
        j = np.clip(np.searchsorted(t.densities, rho, side="right") - 1, 0, len(t.densities) - 2)
        u = (rho - t.densities[j]) / (t.densities[j + 1] - t.densities[j])
        log_att = self._log_attention
        att = (1 - u) * _loglog(log_att[idx, j], log_att[idx + 1, j], offset, width)
        att += u * _loglog(log_att[idx, j + 1], log_att[idx + 1, j + 1], offset, width)
        sel = self._selection(n) if t.selection_scope == "document" else np.zeros_like(n)
        tokens = n * (layers * t.token_layer + t.token_head)
        return np.stack([tokens, layers * att * present, layers * sel * present], axis=1)

    def _batch_terms(self, num_tokens: float) -> np.ndarray:
        """Unscaled (stream-scoped selection, overhead) seconds of a micro-batch over all layers."""
        t = self.table
        stream = t.selection_scope == "stream" and num_tokens > 0
        selection = self.num_layers * float(self._selection(np.array([num_tokens]))[0]) if stream else 0.0
        return np.array([selection, self.num_layers * t.layer_overhead + t.model_overhead])

    def _selection(self, n: np.ndarray) -> np.ndarray:
        idx, offset, width = _segments(self._log_lengths, np.log(np.maximum(n, 1.0)))
        return _loglog(self._log_selection[idx], self._log_selection[idx + 1], offset, width)

    def _raw_terms(self, doc_lengths: ArrayLike, density: ArrayLike) -> np.ndarray:
        """Unscaled seconds per term (``TERMS``) of a whole micro-batch."""
        docs = self._doc_terms(doc_lengths, density)
        raw = np.append(docs.sum(axis=0), 0.0)
        raw[2:] += self._batch_terms(float(_as_lengths(doc_lengths).sum()))
        return raw

    # ---------------------------------------------------------------------------------------- calibration
    def fit_scales(self, samples: Sequence[tuple[ArrayLike, ArrayLike, float]], *, ridge: float = 0.1) -> np.ndarray:
        """Per-term scales (``TERMS`` order) that best explain measured whole micro-batch times, given as
        (doc_lengths, density, seconds): least squares on log times (relative errors count alike), pulled
        towards 1 by ``ridge`` so a term the samples barely exercise keeps its measured size.

        The profiler uses it to fold what isolated parts miss when composed (the layer glue, memory
        traffic between them) into the table; ``observe`` does the same online, one step at a time.
        """
        raw = np.array([self._raw_terms(lengths, density) for lengths, density, _ in samples])
        log_seconds = np.log([seconds for *_, seconds in samples])
        x = np.zeros(len(TERMS))
        for _ in range(50):  # Gauss-Newton: the log of a positive sum is smooth and nearly linear here
            scaled = raw * np.exp(x)
            predicted = scaled.sum(axis=1)
            jacobian = scaled / predicted[:, None]
            gradient = jacobian.T @ (log_seconds - np.log(predicted)) - ridge * x
            step = np.linalg.solve(jacobian.T @ jacobian + ridge * np.eye(len(TERMS)), gradient)
            x = np.clip(x + step, -7.0, 7.0)
            if np.abs(step).max() < 1e-6:
                break
        return np.exp(x)

    def observe(
        self,
        doc_lengths: ArrayLike,
        density: ArrayLike,
        seconds: float,
        *,
        terms: Sequence[str] = TERMS,
        forget: bool = True,
    ) -> float:
        """Correct the model from one measured time; returns the prediction made before the update.

        ``terms`` names what ``seconds`` covers when it is not the whole forward+backward (for example
        ``("attention", "selection")`` for timings of the attention calls alone, which are free of
        collectives under FSDP, where a fast rank's whole step waits for the slowest). ``forget=False``: one
        of several measurements of one round, whose caller calls ``calibration.forget()`` once after them.
        """
        unknown = set(terms) - set(TERMS)
        if unknown:
            raise ValueError(f"unknown terms {sorted(unknown)}; allowed: {TERMS}")
        mask = np.array([name in terms for name in TERMS], dtype=np.float64)
        raw = self._raw_terms(doc_lengths, density) * mask
        before = float(raw @ self.calibration.scales)
        self.calibration.update(raw, float(seconds), forget=forget)
        return before

    # -------------------------------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """Table and calibration as plain JSON-able data (for checkpoints and ``save``)."""
        return {"table": self.table.to_dict(), "calibration": self.calibration.to_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        restored = LatencyModel.from_state(state)
        self.__dict__.update(restored.__dict__)

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> LatencyModel:
        if not isinstance(state, Mapping) or "table" not in state:
            raise LatencyTableError("latency state has no 'table' entry")
        try:
            calibration = OnlineCalibration(**state["calibration"]) if state.get("calibration") else None
        except (TypeError, ValueError) as err:
            raise LatencyTableError(f"latency calibration state is malformed: {err!r}") from err
        return cls(LatencyTable.from_dict(state["table"]), calibration)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.state_dict(), indent=1))
        tmp.replace(path)
        return path

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        dims: Any = None,
        *,
        block_size: int | None = None,
        stride: int | None = None,
        selection: dict | None = None,
    ) -> LatencyModel:
        """Load a saved model; raises ``LatencyTableError`` naming the file and the reason when it is unusable.

        With ``dims`` (and optionally ``block_size``, ``stride``, the ``selection`` options) the table must have
        been profiled for those settings.
        """
        path = Path(path)
        try:
            state = json.loads(path.read_text())
            model = cls.from_state(state)
        except FileNotFoundError as err:
            raise LatencyTableError(f"latency table {path} does not exist") from err
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise LatencyTableError(f"latency table {path} is unreadable or not JSON: {err}") from err
        except LatencyTableError as err:
            raise LatencyTableError(f"latency table {path}: {err}") from err
        if dims is not None:
            why = model.table.meta.mismatch(dims, block_size, stride, selection)
            if why:
                raise LatencyTableError(f"latency table {path} was profiled for another setup ({why})")
        return model

    @classmethod
    def load_or_none(
        cls,
        path: str | Path,
        dims: Any,
        *,
        block_size: int,
        stride: int,
        selection: dict | None = None,
    ) -> LatencyModel | None:
        """``from_file`` that logs a warning with the reason and returns None, so the caller can fall back.
        Where the table was measured (device, dtype, lengths) is the caller's to judge."""
        try:
            return cls.from_file(path, dims, block_size=block_size, stride=stride, selection=selection)
        except LatencyTableError as err:
            log.warning("%s; falling back", err)
            return None

    # ----------------------------------------------------------------------------------- analytic prior
    @classmethod
    def analytic(
        cls,
        dims: Any,
        *,
        block_size: int,
        stride: int,
        flops_per_second: float = 5e10,
        attention_efficiency: float = 0.5,
        layer_overhead: float = 1e-4,
        device: str = "unknown",
        dtype: str = "float32",
        selection: dict | None = None,
    ) -> LatencyModel:
        """A prior from FLOP counts at an assumed throughput, for when no profiled table exists.

        GEMMs run at ``flops_per_second`` (forward, plus twice that for backward); attention and selection
        at ``attention_efficiency`` of it. Attention counts kept B x B tiles, with the diagonal and first
        block of each document always kept (the selection never drops them); selection scores stride-level antidiagonals,
        about 1/stride of dense QK^T, plus ``selection["recall_probes"]`` exact rows per query block.
        ``observe`` corrects each term's scale from measured times.
        """
        options = selection_options(**(selection or {}))
        d = cost_dims(dims)
        h, hq, hkv, hd = d["hidden_size"], d["num_heads"], d["num_kv_heads"], d["head_dim"]
        gemm = flops_per_second
        slow = flops_per_second * attention_efficiency
        token_layer = 3 * 2 * (h * hq * hd + 2 * h * hkv * hd + hq * hd * h + 3 * h * d["intermediate_size"]) / gemm
        token_head = 3 * 2 * h * d["vocab_size"] / gemm
        lengths = 2.0 ** np.arange(6, 18)
        densities = np.array([0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0])
        tiles = kept_tiles(lengths[:, None], densities[None, :], block_size)
        attention = tiles * 3.5 * 4 * block_size**2 * hd * hq / slow  # backward ~2.5x forward
        probe_rows = options["recall_probes"] * lengths / block_size
        selection = hq * lengths * hd * (lengths / stride + probe_rows) / slow
        table = LatencyTable(
            meta=TableMeta(dims=d, block_size=block_size, stride=stride, device=device, dtype=dtype, source="analytic",
                           notes={"flops_per_second": flops_per_second, "attention_efficiency": attention_efficiency},
                           selection=options),
            lengths=lengths,
            densities=densities,
            attention=attention,
            selection=selection,
            token_layer=token_layer,
            token_head=token_head,
            layer_overhead=layer_overhead,
            model_overhead=layer_overhead,
            selection_scope="stream",
        )
        return cls(table)


def kept_tiles(lengths: ArrayLike, density: ArrayLike, block_size: int) -> np.ndarray:
    """Kept B x B tiles of a document: ``density`` of its causal tiles, never fewer than diagonal + first."""
    blocks = np.ceil(np.asarray(lengths, dtype=np.float64) / block_size)
    causal = blocks * (blocks + 1) / 2
    floor = np.minimum(2 * blocks - 1, causal)
    return np.maximum(np.asarray(density, dtype=np.float64) * causal, floor)


def _as_lengths(lengths: ArrayLike) -> np.ndarray:
    n = np.atleast_1d(np.asarray(lengths, dtype=np.float64))
    if n.ndim != 1 or np.any(n < 0) or not np.all(np.isfinite(n)):
        raise ValueError("document lengths must be a 1-D sequence of non-negative numbers")
    return n


def _segments(grid: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segment index of each x on an increasing grid, its (unclipped) offset from the segment start, and the width."""
    idx = np.clip(np.searchsorted(grid, x, side="right") - 1, 0, len(grid) - 2)
    return idx, x - grid[idx], grid[idx + 1] - grid[idx]


def _loglog(lo: np.ndarray, hi: np.ndarray, offset: np.ndarray, width: np.ndarray) -> np.ndarray:
    """Interpolate log(value) linearly in log(length) between segment ends; beyond the grid, extend the end
    slope clipped to [0, 2.5] (costs never fall with length and grow at most a little faster than quadratic)."""
    slope = (hi - lo) / width
    outside = np.clip(slope, 0.0, 2.5)
    below = lo + offset * outside
    inside = lo + offset * slope
    above = hi + (offset - width) * outside
    return np.exp(np.where(offset < 0, below, np.where(offset > width, above, inside)))
