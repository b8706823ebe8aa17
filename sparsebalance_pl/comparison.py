"""Variants compared over N emulated data-parallel ranks in one process, and the results they leave behind.

Each variant (``sparsebalance_pl.variants``) is set up as ``main.py fit`` would set it up (``emulation.build``),
its epoch planned for N ranks, and run on ``EmulatedRanks``; the variants' steps take turns, since a shared
machine's speed drifts over minutes and taking turns spreads the drift over all of them. What a variant's cost
model and DST controller held when its epoch started is written beside it (``CALIBRATED_STATE``), and the
results with the comparison's settings (``RESULTS``), so that a later analysis (the simulation's check, a
replayed step) can set the same variant up again and predict or replay exactly what ran.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import yaml
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from sparsebalance_pl.balance import balance_efficiency, imbalance
from sparsebalance_pl.cost.contention import CpuContention, measure_contention
from sparsebalance_pl.dst import DSTController
from sparsebalance_pl.emulation import (
    EmulatedRanks, EmulatedStep, allreduce_seconds, build, step_batches, validation_loss,
)
from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.progress import LoggedProgress
from sparsebalance_pl.variants import BASELINE, VARIANTS, ComparisonSettings, run_folder, variant_config, variant_kind

#: Where an emulated variant keeps the state its cost model and DST controller start the epoch with.
CALIBRATED_STATE = "calibrated_state.json"
#: The comparison's results, in its ``out`` folder.
RESULTS = "results.json"


class PreparedVariant(NamedTuple):
    """A variant set up as a real run is before its first step."""

    module: Any
    data: Any
    trainer: Any
    controller: DSTController
    plan: list


def prepare_variant(base: dict, spec: str, settings: ComparisonSettings, round_index: int,
                    calibrated: dict | None = None) -> PreparedVariant:
    """Variant ``spec``'s model, data module, Trainer, DST controller and epoch plan for ``settings.ranks`` ranks.

    The ``settings.calibrate_steps`` steps run here, and the cost model's and controller's state after them is
    written to ``CALIBRATED_STATE`` in the variant's folder, with the ranks' times against their predictions in
    those steps after the first (``residuals``, per step and rank, log of measured over predicted); with
    ``calibrated`` (such a file's contents) that state is loaded instead, so a prediction starts from what the
    measured epoch started from."""
    run_dir = run_folder(settings.out, spec, round_index)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(variant_config(base, spec, settings, run_dir), sort_keys=False))
    # a calibrated state brings its own latency table and density estimate: profiling this process's hardware
    # would be wasted, and would overwrite the table file the emulation used (a check run on other threads, say)
    module, data, trainer = build(["--config", str(config_path)]
                                  + (["--model.latency_profile=false"] if calibrated is not None else []))
    attention = module.sparse_attention
    if VARIANTS[variant_kind(spec)][0] == "sparse" and calibrated is None:  # as DensityCalibration before an epoch
        module.calibrate_density(data.calibration_batches(min_length=attention.config.block_size))
    controller = DSTController(attention.cost_model, attention.base_budgets, **settings.dst(spec))
    if calibrated is not None:
        attention.cost_model.load_state_dict(calibrated["cost_model"])
        controller.load_state_dict(calibrated["controller"])
    else:
        residuals = _calibrate(module, data, controller, spec, settings)
        state = {"cost_model": attention.cost_model.state_dict(), "controller": controller.state_dict(),
                 "residuals": residuals}
        (run_dir / CALIBRATED_STATE).write_text(json.dumps(state, default=lambda array: array.tolist()))
    plan = data.train_plan(settings.ranks, rank=0).plan()
    plan = plan if settings.epoch_documents is not None else plan[: settings.steps]
    return PreparedVariant(module, data, trainer, controller, plan)


def _calibrate(module, data, controller: DSTController, spec: str, settings: ComparisonSettings) -> list[list[float]]:
    """Run the calibration steps (another epoch's documents, no updates); per step after the first, each rank's
    log of measured over predicted seconds (the first step's predictions come from the uncalibrated table)."""
    if not settings.calibrate_steps:
        return []
    ranks = EmulatedRanks(module, settings.ranks, 1, controller=controller, repeats=settings.repeats)
    items = data.items("train")
    steps = data.train_plan(settings.ranks, rank=0, epoch=1).plan()[: settings.calibrate_steps]
    residuals = []
    with LoggedProgress(transient=True) as bar:
        for i, step in enumerate(bar.track(steps, description=f"calibrating {spec}")):
            done = ranks.step(step_batches(items, step), update=False)
            if i:
                residuals.append([math.log(m / q) for m, q in zip(done.rank_seconds, done.predicted_seconds)])
    return residuals


class _Run(NamedTuple):
    """One variant's emulation under way: its model, data, epoch plan, ranks, packed items and steps done."""

    module: Any
    data: Any
    plan: list
    ranks: EmulatedRanks
    items: Any
    done: list[EmulatedStep]


def emulate_variants(base: dict, settings: ComparisonSettings, round_index: int) -> dict[str, dict]:
    """Every variant of ``settings`` over its emulated ranks, their epochs' steps interleaved (a step of each in
    turn); all variants' models are held at once. Each summed up by ``summarise``."""
    runs: dict[str, _Run] = {}
    for spec in settings.variants:
        module, data, trainer, controller, plan = prepare_variant(base, spec, settings, round_index)
        if len(plan) <= settings.warmup:  # known before any step runs, which may be hours before the summary
            raise ConfigError(f"variant {spec} plans {len(plan)} steps: none is left after --warmup {settings.warmup}")
        ranks = EmulatedRanks(module, settings.ranks, len(plan), controller=controller,
                              gradient_clip=trainer.gradient_clip_val,
                              gradient_clip_algorithm=trainer.gradient_clip_algorithm or "norm",
                              repeats=settings.repeats)
        items = data.items("train")
        ranks.warm_up(step_batches(items, plan[0])[0][0])
        runs[spec] = _Run(module, data, plan, ranks, items, [])
    columns = (TextColumn("emulating {task.description:<24}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    with LoggedProgress(*columns) as bar, measure_contention(torch.get_num_threads()) as contention:
        task = bar.add_task("", total=sum(len(run.plan) for run in runs.values()))
        for i in range(max(len(run.plan) for run in runs.values())):
            for spec, run in runs.items():
                if i < len(run.plan):
                    bar.update(task, description=f"{spec} step {i + 1}/{len(run.plan)}")
                    run.done.append(run.ranks.step(step_batches(run.items, run.plan[i]), update=not settings.frozen))
                    bar.advance(task)
    losses: dict[str, float] = {}  # frozen weights: every variant of a backend ends with the model it started from
    summaries = {}
    for spec, run in runs.items():
        key = VARIANTS[variant_kind(spec)][0] if settings.frozen else spec
        if key not in losses:
            losses[key] = validation_loss(run.module, run.data)
        summaries[spec] = summarise(spec, run.module, run.done, settings, losses[key], contention)
    return summaries


def summarise(spec: str, module, done: list[EmulatedStep], settings: ComparisonSettings, val_loss: float,
              contention: CpuContention) -> dict:
    """One variant's emulated epoch summed up, with its measured validation loss and the other work on the
    machine's CPUs while the variants were timed: the figures the benchmark's table compares, the curves it
    plots (``curves``) and every step's per-rank times (``steps_detail``), which the simulation's check reads."""
    records = [record for step in done for observation in step.observations for record in observation.records]
    recalls = [(sum(r.lengths), r.report.recall) for r in records if r.report.recall is not None]
    rank_s = [step.rank_seconds for step in done]
    step_s = [step.seconds for step in done]
    timed = rank_s[settings.warmup:]
    parameters = sum(p.numel() for p in module.parameters())
    return {
        "steps": len(done),
        "hidden_size": module.dims.hidden_size,
        "total_s": sum(step_s),
        "first_run_total_s": sum(step.first_run_seconds for step in done),
        "step_s": statistics.median(step_s[settings.warmup:]),
        "tokens": sum(step.tokens for step in done),
        "tokens_per_s": sum(step.tokens for step in done) / sum(step_s),
        "measured_imbalance": statistics.median(imbalance(r) for r in timed),
        "balance_efficiency": balance_efficiency(rank_s),
        "removable_imbalance": sum(max(r) for r in rank_s) / sum(statistics.fmean(r) for r in rank_s),
        "attention_share_of_compute": sum(r.report.attention_seconds for r in records) / sum(map(sum, rank_s)),
        "collective_estimate_s": len(done) * allreduce_seconds(parameters, settings.ranks, settings.bandwidth_gbps),
        "train_loss": statistics.fmean(step.loss for step in done[-5:]),
        "val_loss": val_loss,
        "recall": sum(n * r for n, r in recalls) / sum(n for n, _ in recalls) if recalls else math.nan,
        "density": statistics.fmean(r.report.mean_density for r in records),
        "other_cpu_cores": math.nan if contention.other_cores is None else contention.other_cores,
        "spare_cpu_cores": contention.spare_cores,
        "curves": {
            "step_s": list(enumerate(step_s)),
            "imbalance": [(i, imbalance(r)) for i, r in enumerate(rank_s)],
            "loss": [(i, step.loss) for i, step in enumerate(done)],
        },
        "steps_detail": [{"rank_s": step.rank_seconds, "rank_draws": step.rank_draws, "step_s": step.seconds,
                          "tokens": step.tokens,
                          "rounds": [o.replay_dict() for o in step.observations]} for step in done],
    }


def regime(base: dict, results: dict[str, dict], settings: ComparisonSettings) -> dict:
    """What decides the gain: attention's share of a step (its FLOP ratio to the projections, and as measured)
    and how much imbalance the baseline leaves (the most balancing can remove)."""
    reference = results.get(BASELINE) or next(iter(results.values()))
    length = settings.max_tokens or base["data"]["batching"]["max_tokens"]
    return {
        "ranks": settings.ranks,
        "max_tokens": length,
        "hidden_size": reference["hidden_size"],
        "attention_to_projection_flops": length / (6 * reference["hidden_size"]),
        "baseline_attention_share_of_compute": reference["attention_share_of_compute"],
        "baseline_removable_imbalance": reference["removable_imbalance"],
        "baseline_density": reference["density"],
        "baseline_recall": reference["recall"],
        "collective_estimate_s": reference["collective_estimate_s"],
        "bandwidth_gbps": settings.bandwidth_gbps,
        "calibration_steps": settings.calibrate_steps,
        "timing_repeats": settings.repeats,
        "threads": torch.get_num_threads(),
        "other_cpu_cores": reference["other_cpu_cores"],
        "spare_cpu_cores": reference["spare_cpu_cores"],
        "frozen_weights": settings.frozen,
        "collectives": "not in the step times; estimated apart as a ring all-reduce of fp32 gradients",
    }


def save_results(settings: ComparisonSettings, results: dict[str, dict], regime_of_run: dict) -> Path:
    """Write ``RESULTS`` into ``settings.out``: per variant its figures and every step (``steps``), the regime,
    and the settings that set each variant up again."""
    variants = {
        spec: {**{k: v for k, v in r.items() if k not in ("curves", "steps_detail")}, "steps": r["steps_detail"]}
        for spec, r in results.items()
    }
    path = Path(settings.out) / RESULTS
    path.write_text(json.dumps({"variants": variants, "regime": regime_of_run, "settings": asdict(settings)}, indent=1))
    return path


def load_results(folder: str | Path) -> tuple[ComparisonSettings, dict, dict]:
    """The settings (with ``out`` the folder read), the variants' results and the regime of the comparison saved
    in ``folder``."""
    folder = Path(folder)
    saved = json.loads((folder / RESULTS).read_text())
    if "settings" not in saved:
        raise ConfigError(f"{folder / RESULTS} keeps no settings to set its variants up again: run it again")
    settings = replace(ComparisonSettings(**saved["settings"]), out=str(folder))
    return settings, saved["variants"], saved["regime"]


def calibrated_state(folder: str | Path, spec: str) -> dict | None:
    """The state variant ``spec`` of the comparison in ``folder`` started its epoch with; None where it kept none."""
    path = run_folder(folder, spec, 0) / CALIBRATED_STATE
    return json.loads(path.read_text()) if path.is_file() else None
