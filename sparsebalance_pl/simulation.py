"""Predicted epochs of many data-parallel ranks: the real planner and DST controller, times from the cost model.

The planner (``SparsityAwareSampler``: SAB, or first-fit for the baselines) plans one epoch for N ranks and the
DST controller picks every rank's budget at every micro-batch round, exactly as in training; each rank's time is
then what the cost model predicts for its documents at its budget, and a step lasts as long as its slowest rank
(collectives and the optimiser left out, as in the emulation). No model runs, so 64 ranks at 128K tokens take
seconds where the emulation would take days. A real rank's time strays from its prediction, and a balanced step
lasts as long as the rank the cost model under-predicted most, so the ranks' times stray here too, by a
log-normal factor (``expected_epoch_seconds``). What it cannot show: a cost model wrong in a systematic way.

``check_against_emulation`` predicts an emulated comparison's own plans (``sparsebalance_pl.comparison``) from the
state each variant started its epoch with, beside the times the emulation measured: how far to trust the
simulation at sizes no emulation reaches.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import replace
from importlib import resources
from pathlib import Path

import numpy as np

from sparsebalance_pl.balance import balance_efficiency
from sparsebalance_pl.cost import CostModel, DensityEstimator
from sparsebalance_pl.datamodules.sampler import BatchingConfig, EpochPlan, PaddingItem, SparsityAwareSampler
from sparsebalance_pl.dst import DSTController
from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.kernels.selection import LayerBudget
from sparsebalance_pl.latency import LatencyModel
from sparsebalance_pl.variants import BASELINE, VARIANTS, merged_configs, variant_kind

#: The median of |z| for a standard normal z: a log-normal spread s has median |log| of 0.6745 s.
MEDIAN_ABS_NORMAL = 0.6745


def h100_figures() -> dict:
    """The H100 measurements ``h100_latency`` is fitted to, with the report that holds them (``source``)."""
    return json.loads((resources.files("sparsebalance_pl") / "resources" / "h100_figures.json").read_text())


def h100_latency(dims, dense: bool = False) -> LatencyModel:
    """The analytic latency model with its throughputs fitted to measured H100 times (``h100_figures``), for
    simulating a GPU cluster from a machine without one: the per-token terms to the whole-model step less its
    cuDNN attention, attention to the full-density time of our kernel (of cuDNN with ``dense``), selection to
    its measured time. Linear in kept tiles: the kernel's fixed costs at short lengths are not in it."""
    figures = h100_figures()
    attention_s = figures["cudnn_attention_128k_s" if dense else "attention_128k_s"]
    flops = LatencyModel.analytic(dims, block_size=64, stride=16, flops_per_second=1.0, attention_efficiency=1.0)
    table = flops.table  # FLOP counts (seconds at 1 FLOP/s), the fixed overheads in seconds
    # the dense step's attention at 32K is 1/16 of its time at 128K: attention is quadratic in the length
    per_token = (figures["model_32k_s"] - dims.num_layers * figures["cudnn_attention_128k_s"] / 16) / 32768
    token_flops = table.token_layer * dims.num_layers + table.token_head
    attention_flops = np.interp(131072, table.lengths, table.attention[:, -1])
    selection_flops = np.interp(131072, table.lengths, table.selection)
    scales = [per_token / token_flops, attention_s / attention_flops, figures["selection_128k_s"] / selection_flops,
              1.0]
    meta = replace(table.meta, device=f"H100 (analytic, fitted to {figures['source']})", dtype=figures["dtype"])
    return LatencyModel(replace(table.scaled(scales), meta=meta))


def density_law(block_size: int, density: float, at_tokens: int, exponent: float = 0.5) -> DensityEstimator:
    """The estimator's length law, (dense_blocks / blocks) ** exponent, through ``density`` at ``at_tokens``: a
    model's measured density at one length stands for its densities at all lengths."""
    blocks = at_tokens / block_size
    return DensityEstimator(block_size=block_size, dense_blocks=blocks * density ** (1.0 / exponent),
                            exponent=exponent)


def plan_lengths(micro_batch: Sequence, lengths: np.ndarray) -> list[int]:
    """Token counts of a planned micro-batch's documents, padding included (the ranks compute it)."""
    return [int(lengths[item.index if isinstance(item, PaddingItem) else item]) for item in micro_batch]


def plan_tokens(plan: EpochPlan, lengths: np.ndarray) -> int:
    """Tokens the ranks compute over the whole plan."""
    return sum(sum(plan_lengths(mb, lengths)) for step in plan for rank in step.micro_batches for mb in rank)


def predicted_epoch(plan: EpochPlan, lengths: np.ndarray, controller: DSTController, noise: float = 0.0,
                    seed: int = 0) -> list[list[float]]:
    """Every step's predicted seconds per rank: each micro-batch round's budgets from ``controller`` as DST
    picks them in training, each rank's time the cost model's prediction at them. After each round the cost
    model's ``error`` learns the ranks' log-normal stray of spread ``noise`` (drawn, seeded), as a live run's
    learns its measured one: DST trusts its predictions as much as the run would by then (a model started with
    a few calibration steps' large error would otherwise hold DST back all epoch)."""
    rng, steps = np.random.default_rng(seed), []
    for step in plan:
        rank_s = np.zeros(len(step.micro_batches))
        for m in range(len(step.micro_batches[0])):
            rank_s += controller.plan([plan_lengths(rank[m], lengths) for rank in step.micro_batches]).predicted
            if noise > 0:
                controller.cost_model.track_error(np.abs(noise * rng.standard_normal(len(step.micro_batches))))
        steps.append(rank_s.tolist())
    return steps


def rank_noise(log_errors: Sequence[Sequence[float]]) -> float:
    """The log-normal spread of ranks' times around their predictions, from log(measured / predicted) per step
    and rank. Each step's errors are taken about their mean: an error all ranks of a step share moves the
    epoch's time, not its balance. A robust standard deviation (the median absolute deviation over
    ``MEDIAN_ABS_NORMAL``, corrected for the centring), so one descheduled rank does not set it."""
    deviations = [np.asarray(step, dtype=np.float64) - np.mean(step) for step in log_errors if len(step) > 1]
    if not deviations:
        return 0.0
    scaled = np.concatenate([d * math.sqrt(d.size / (d.size - 1)) for d in deviations])
    return float(np.median(np.abs(scaled - np.median(scaled)))) / MEDIAN_ABS_NORMAL


def rank_noise_of_error(error: float) -> float:
    """The log-normal spread whose median |log| is ``error`` (the cost model's ``error``)."""
    return error / MEDIAN_ABS_NORMAL


def expected_epoch_seconds(steps: list[list[float]], noise: float, draws: int = 2000, seed: int = 0) -> float:
    """The sum over steps of the slowest rank's time, in expectation when every rank's time is its prediction
    times an independent log-normal factor of spread ``noise`` (median 1)."""
    if noise <= 0:
        return sum(max(r) for r in steps)
    rng = np.random.default_rng(seed)
    return sum(float((np.asarray(r) * np.exp(noise * rng.standard_normal((draws, len(r))))).max(axis=1).mean())
               for r in steps)


def epoch_summary(steps: list[list[float]], tokens: int, noise: float = 0.0) -> dict:
    """An epoch of predicted per-rank step times summed up as the emulated comparison sums its measured ones:
    ``total_s`` with the ranks' times strayed by ``noise`` (``expected_epoch_seconds``), ``exact_s`` without."""
    total = expected_epoch_seconds(steps, noise)
    return {
        "steps": len(steps),
        "total_s": total,
        "exact_s": expected_epoch_seconds(steps, 0.0),
        "rank_noise": noise,
        "tokens": tokens,
        "tokens_per_s": tokens / total,
        "removable_imbalance": total / sum(statistics.fmean(r) for r in steps),
        "balance_efficiency": balance_efficiency(steps),
    }


def simulate_variant(lengths: np.ndarray, spec: str, dst: dict, latency: LatencyModel,
                     density: DensityEstimator | None, *, num_layers: int, tau: float, ranks: int, max_tokens: int,
                     defer_window: int, prediction_error: float, seed: int = 0) -> dict:
    """One epoch of ``lengths`` for ``ranks`` ranks in variant ``spec`` (DST settings ``dst``), summed up by
    ``epoch_summary``. The cost model starts with ``prediction_error`` as its error, and the ranks stray from
    its predictions by as much, so DST trusts the predictions as a calibrated run would."""
    _, batching, _ = VARIANTS[variant_kind(spec)]
    cost = CostModel(latency, density)
    cost.error = prediction_error
    controller = DSTController(cost, [LayerBudget(tau=tau)] * num_layers, **dst)
    config = BatchingConfig(method=batching, max_tokens=max_tokens,
                            defer_window=defer_window if batching == "sab" else 0)
    plan = SparsityAwareSampler(lengths, config, cost_model=cost, seed=seed, num_replicas=ranks, rank=0).plan()
    noise = rank_noise_of_error(prediction_error)
    return epoch_summary(predicted_epoch(plan, lengths, controller, noise, seed), plan_tokens(plan, lengths), noise)


def fit_on_others(cost_model: CostModel, measured: dict, spec: str) -> int:
    """Teach ``cost_model`` every micro-batch round the other variants of an emulated comparison measured, in the
    run's order: a calibration on many steps of several plans' batch shapes that never saw the variant it then
    predicts. Returns how many rounds it learned from (0 for a run that did not keep them)."""
    rounds = [r for other, got in measured.items() if other != spec for step in got["steps"]
              for r in step.get("rounds", [])]
    cost_model.warmup_left = 0  # measured steps, warm already
    for step in rounds:
        cost_model.replay(step)
    return len(rounds)


def check_against_emulation(folder: str | Path, scratch: str | Path, variants: Sequence[str] | None = None) -> dict:
    """Predicted epoch times of the emulated comparison in ``folder`` (its own plans, from the cost model and
    controller each variant started its epoch with, its ranks straying as much as they did around the
    predictions of the calibration steps) beside the times it measured. Each variant is predicted a second time
    after its cost model learned every round the other variants measured (``fit_on_others``). The variants'
    configurations are written again under ``scratch``."""
    # here, not at the top: setting a variant up needs Lightning, which the cluster simulation does without
    from sparsebalance_pl.comparison import calibrated_state, load_results, prepare_variant

    settings, measured, _ = load_results(folder)
    names = [v for v in measured if variants is None or v in variants]
    states = {}
    for name in names:
        states[name] = calibrated_state(folder, name)
        if states[name] is None:
            raise ConfigError(f"{folder}: variant {name!r} kept no calibrated state to predict from")
    setup = replace(settings, out=str(scratch))
    base = merged_configs(settings.configs)
    # one machine, one model: every variant's calibration steps measure the same spread
    noise = rank_noise([step for state in states.values() for step in state["residuals"]])
    rows = {}
    for name in names:
        _, data, _, controller, plan = prepare_variant(base, name, setup, 0, calibrated=states[name])
        lengths = np.asarray(data.lengths("train"))
        tokens = plan_tokens(plan, lengths)

        def predict() -> dict:
            return epoch_summary(predicted_epoch(plan, lengths, controller, noise), tokens, noise)

        predicted = predict()
        got = measured[name]
        compute = sum(max(step["rank_s"]) for step in got["steps"])  # the emulation's step less its optimiser
        mean_ranks = [statistics.fmean(step["rank_s"]) for step in got["steps"]]
        # the ceiling of any planner for this work: every step's rank-seconds shared evenly, the ranks straying
        balanced = expected_epoch_seconds([[m] * len(s["rank_s"]) for m, s in zip(mean_ranks, got["steps"])], noise)
        rows[name] = {"predicted_s": predicted["total_s"], "exact_s": predicted["exact_s"],
                      "measured_s": compute, "error": predicted["total_s"] / compute - 1.0, "balanced_s": balanced,
                      "predicted_bound": predicted["removable_imbalance"],
                      "measured_bound": compute / sum(mean_ranks)}
        # planning moved the controller's shifts and the cost model's error: start over from the saved state
        controller.load_state_dict(states[name]["controller"])
        controller.cost_model.load_state_dict(states[name]["cost_model"])
        replayed = fit_on_others(controller.cost_model, measured, name)
        if replayed:
            held_out = predict()["total_s"]
            rows[name].update(held_out_s=held_out, held_out_error=held_out / compute - 1.0, replayed_rounds=replayed)
    if BASELINE in rows:  # the speed-up over the baseline that balancing each variant's own work would give
        for row in rows.values():
            row["noise_ceiling"] = rows[BASELINE]["measured_s"] / row["balanced_s"]
    return {"kind": "simulation checked against emulation", "emulated": str(folder), "rank_noise": noise,
            "rows": rows}
